"""The server's vocab-parallel decode tail: `lmtail serve --ranks N` (N > 1).

    RankTail(bundle, N, config=TailConfig(...))   in the server process (rank 0)
      |-- spawn ranks 1..N-1 (daemon, spawn context; each dies with the server)
      |   each gets gamma [H] fp32 and ITS head shard w[:, r*V_s:(r+1)*V_s] [H, V_s] bf16
      |   (shared memory, mapped), a command pipe, and joins the gloo group (tcp store on
      |   127.0.0.1, rank 0 = the server process: the default process group)
    tail(x [B, H] fp32, sp [B, 5] fp32) -> RankOut, every call: the rank step of
      lmtail.model.ranks (generate's group_step runs the same): rank 0 pads to gbs =
      ceil(B / N) * N (pad_step: zero rows, greedy dummies), sends (gbs, x, sp) down each
      command pipe (with the pickled processing list when some row has one; raw bytes: an idle server holds no collective open, so idle time never
      trips a gloo timeout); every rank runs rank_step: decode_tail(config=..., group=WORLD)
      on its shard with the sampling rows it owns (layout.owned_rows), then one all-gather
      of [R, 3 + 2k] int64 per rank (token, logprob bits, truncated, top-k ids, top-k value
      bits) assembles all rows in row order (gathered_rows).
    close(): a stop command down every pipe, join (bounded), terminate leftovers, destroy
    the process group.

Bytes: decode_tail's vocab-parallel path equals the single-rank call on the same global
inputs, bitwise (tests/test_exchange.py, tests/test_candidates.py), and a row's outputs do
not depend on the other rows (zero dummies included); the gather moves bit patterns. So
RankOut's rows are the bytes of decode_tail(x, gamma, w, sampling_params=sp) on one rank
(tests/test_serve.py: an Engine(ranks=2) vs Engine(ranks=1), every token and logprob bit).

Lifetime: a rank exits on a stop command, on EOF of its pipe (the server closed it or
died), on a failed collective, and by PR_SET_PDEATHSIG (launch.die_with_parent) when the
server process dies however it dies. One RankTail per process at a time (it owns the
default process group; a second is a RuntimeError).

Shape legend: B rows of a step, gbs = B rounded up to a multiple of N, R = gbs / N rows a
rank owns, H hidden, V vocab, V_s = V / N vocab shard, k candidates.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..tail.candidates import check_vtp
from ..tail.config import TailConfig
from ..tail.exchange import ExchangeError
from ..launch import stop_processes
from ..kernels.quant.gemm_q import QuantWeight
from ..model.generate import head_weight, step_head
from ..model.ranks import GatheredRows, gathered_rows, pad_step, rank_step
from ..tail.compose import head_shard

_CMD_TAIL, _CMD_STOP, _CMD_TAIL_PROC = 1, 0, 2  # _CMD_TAIL_PROC: the floats, then the pickled processing
_HEADER = struct.Struct("<qq")  # (command, gbs)


RankOut = GatheredRows  # one tail step over all B rows (rank 0's view, rows in call order; topk_values gathered)


def _value_dtype(exchange: str) -> torch.dtype:
    return torch.float32 if exchange == "candidates" else torch.bfloat16


def _rank_step(rank: int, n: int, xp, spp, gamma, w, config: TailConfig, timeout: float,
               processing=None) -> torch.Tensor:
    """This rank's part of one step (collective over the world): model.ranks.rank_step with
    decode_tail on this rank's shard (processing: None or gbs entries, the same on every
    rank). Returns [gbs, 3 + 2k] int64 rows in global row order."""
    from ..tail.compose import decode_tail

    def tail(x, sp_owned):
        return decode_tail(x, gamma, w, config=config, sampling_params=sp_owned, group=dist.group.WORLD,
                           timeout=timeout, processing=processing)

    return rank_step(tail, xp, spp, rank=rank, n=n, values=True, timeout=timeout)


def _worker(rank, n, port, gamma, w, config, timeout, conn, parent_pid, threads):
    """Rank `rank` (>= 1): join the group, then serve tail commands from the pipe until a
    stop command, EOF or a failed collective."""
    from ..launch import die_with_parent

    die_with_parent(parent_pid)
    code = 0
    try:
        torch.set_num_threads(threads)
        td = timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, n, False, timeout=td)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=td)
        hid = gamma.shape[0]
        w = step_head(w, True)  # this rank's shard in its fastest layout, once
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                break
            cmd, gbs = _HEADER.unpack_from(msg)
            if cmd == _CMD_STOP:
                break
            nf = gbs * (hid + 5)  # the floats: x then sp
            body = np.frombuffer(msg, dtype=np.float32, offset=_HEADER.size, count=nf)
            proc = pickle.loads(msg[_HEADER.size + 4 * nf:]) if cmd == _CMD_TAIL_PROC else None
            xp = torch.from_numpy(body[:gbs * hid].copy()).view(gbs, hid)
            spp = torch.from_numpy(body[gbs * hid:].copy()).view(gbs, 5)
            try:
                _rank_step(rank, n, xp, spp, gamma, w, config, timeout, proc)
            except ExchangeError as e:
                print(f"lmtail serve rank {rank}: {e}", file=sys.stderr, flush=True)
                code = 1
                break
            except ValueError:
                continue  # bad inputs: decode_tail refuses them on every rank before any byte moves
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)  # skip interpreter teardown (a failed collective may linger)


def _shared(shard):
    """A head shard in shared memory for a spawned rank: a bf16 tensor, or a QuantWeight
    whose bytes are copied into shared memory (a view of the file's map cannot travel)."""
    if isinstance(shard, torch.Tensor):
        return shard.share_memory_()
    return QuantWeight(shard.fmt, shard.shape, shard.data.clone().share_memory_())


class RankTail:
    """The decode tail over `ranks` gloo ranks, this process being rank 0 (module docstring).

    bundle: the loaded model (its final_norm [H] fp32 and lm_head_weight_t [H, V] bf16);
    ranks: N > 1 dividing V (and 256 with exchange "candidates": candidates.check_vtp);
    config: decode_tail's options on every rank (generate.step_config: its k, exchange,
    head_input ...); timeout_s bounds the start (spawn + group init) and every collective
    (exchange.ExchangeError past it); threads: torch threads per rank (default: this
    process's count)."""

    def __init__(self, bundle, ranks: int, *, config: TailConfig, timeout_s: float = 120.0,
                 threads: int | None = None):
        v = bundle.config.vocab
        if not isinstance(ranks, int) or ranks < 2 or v % ranks:
            raise ValueError(f"ranks must be an int >= 2 dividing the vocab {v}; got {ranks!r}")
        if not isinstance(config, TailConfig):
            raise ValueError(f"config must be a TailConfig; got {type(config).__name__}")
        if config.exchange == "candidates":
            check_vtp(ranks)
        if dist.is_initialized():
            raise RuntimeError("RankTail needs this process's default process group, which already exists "
                               "(one RankTail per process; close the other first)")
        self.n, self.config, self.timeout = ranks, config, float(timeout_s)
        self.hidden = bundle.final_norm.shape[-1]
        self.gamma = bundle.final_norm.reshape(-1).to(torch.float32).contiguous()  # [H]
        head = head_weight(bundle, config.head_input)  # [H, V] bf16, or the [V, H] Q8_0 QuantWeight ("fp32")
        self.w = step_head(head_shard(head, 0, ranks), True)  # rank 0's shard, its fastest layout
        self.broken: str | None = None
        self.procs, self.conns = [], []
        td = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, ranks, True, wait_for_workers=False, timeout=td)
        ctx = mp.get_context("spawn")
        threads = torch.get_num_threads() if threads is None else threads
        try:
            for r in range(1, ranks):
                shard = _shared(head_shard(head, r, ranks))
                recv_end, send_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, daemon=True, name=f"lmtail-serve-rank{r}",
                                args=(r, ranks, self._store.port, self.gamma.clone().share_memory_(), shard,
                                      config, self.timeout, recv_end, os.getpid(), threads))
                p.start()
                recv_end.close()
                self.procs.append(p)
                self.conns.append(send_end)
            dist.init_process_group("gloo", store=self._store, rank=0, world_size=ranks, timeout=td)
        except BaseException:
            self._reap(0.0)
            raise

    def tail(self, x: torch.Tensor, sp: torch.Tensor, processing=None) -> RankOut:
        """decode_tail's sampling outputs for x [B, H] fp32 (the rows' pre-final-norm hidden
        states), sp [B, 5] fp32 (sampler.sampling_tensor rows) and processing (None or B
        entries of processors.LogitProcessing | None: padded with None to gbs, pickled down
        each pipe), over the ranks: the bytes of the single-rank decode_tail(x, gamma, w,
        config=config, sampling_params=sp, processing=processing) (module docstring). ValueError for inputs decode_tail refuses (the ranks stay up);
        ExchangeError when a rank fails (the RankTail is then broken: RuntimeError after)."""
        if self.broken is not None:
            raise RuntimeError(f"the serve ranks are down: {self.broken}")
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != torch.float32:
            raise ValueError(f"x must be [B, {self.hidden}] fp32; got {tuple(x.shape)} {x.dtype}")
        if sp.shape != (x.shape[0], 5) or sp.dtype != torch.float32:
            raise ValueError(f"sp must be [{x.shape[0]}, 5] fp32; got {tuple(sp.shape)} {sp.dtype}")
        xp, spp = pad_step(x, sp, self.n)
        proc = None if processing is None else list(processing) + [None] * (xp.shape[0] - x.shape[0])
        msg = (_HEADER.pack(_CMD_TAIL if proc is None else _CMD_TAIL_PROC, xp.shape[0]) + xp.numpy().tobytes()
               + spp.numpy().tobytes() + (b"" if proc is None else pickle.dumps(proc)))
        try:
            for c in self.conns:
                c.send_bytes(msg)
            full = _rank_step(0, self.n, xp, spp, self.gamma, self.w, self.config, self.timeout, proc)
        except ValueError:
            raise
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise
        return gathered_rows(full, x.shape[0], _value_dtype(self.config.exchange))

    def alive(self) -> list[int]:
        """The pids of rank processes still running."""
        return [p.pid for p in self.procs if p.is_alive()]

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the ranks: a stop command down each pipe, join within `timeout` s, terminate
        (then kill) what is left, destroy the process group. True when every rank had
        exited by itself. Idempotent."""
        for c in self.conns:
            try:
                c.send_bytes(_HEADER.pack(_CMD_STOP, 0))
            except OSError:
                pass
        return self._reap(timeout)

    def _reap(self, timeout: float) -> bool:
        clean = stop_processes(self.procs, settle_s=timeout)
        for c in self.conns:
            c.close()
        self.conns = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self.broken = self.broken or "closed"
        return clean
