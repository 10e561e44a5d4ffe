"""The GGUF reader lmtail loads with (lmtail.model.gguf_read) against gguf-py's GGUFReader:
every metadata value and every tensor's dtype, shape, offset and bytes equal on the shipped
SmolLM2 file and on written files holding every value type and the string arrays the bulk
path cannot prove (empty strings, NULs, 64 KiB strings); the tokenizer built from it gives the
ids of one built the old way from gguf-py's lists; the tensors stay views of the map; a bad
file is refused naming what is wrong; load_model(weights="file") is cold-start fast (issue 32
item 6: it took ~4 s in gguf-py's per-string field walk). Planted: the chain proof switched off,
the separator off by one byte: the equality goes red."""
from __future__ import annotations

import random
import struct
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lmtail.model import gguf_read  # noqa: E402
from lmtail.model.gguf_read import read_gguf  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from lmtail.model.gguf_loader import ModelFileMissing, locate_gguf

    try:
        return str(locate_gguf())
    except ModelFileMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_ref(smollm2_path):
    return gguf.GGUFReader(smollm2_path)


def differences(ref, got) -> list[str]:
    """Every way `got` (read_gguf) differs from `ref` (gguf.GGUFReader); [] when equal.
    Values: same Python type and value (numbers compared as their stored bits via the reference's
    numpy parts); tensors: name, type, shape, offset, dtype, numpy shape and bytes."""
    out = []
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    if keys != list(got.fields):
        out.append(f"keys {keys} != {list(got.fields)}")
    for k in keys:
        if k not in got.fields:
            continue
        a, b = ref.fields[k].contents(), got.fields[k]
        if isinstance(b, np.ndarray):
            ref_bits = np.concatenate([ref.fields[k].parts[i] for i in ref.fields[k].data])
            if b.dtype != ref_bits.dtype.newbyteorder("<") or b.tobytes() != ref_bits.tobytes():
                out.append(f"{k}: array {b.dtype} differs")
            b = b.tolist()
        if type(a) is not type(b) or a != b:
            out.append(f"{k}: {str(a)[:60]!r} != {str(b)[:60]!r}")
    if [t.name for t in ref.tensors] != [t.name for t in got.tensors]:
        out.append("tensor names differ")
    for a, b in zip(ref.tensors, got.tensors):
        if (a.tensor_type, [int(s) for s in a.shape], int(a.data_offset), a.n_bytes, a.n_elements) != \
                (b.tensor_type, list(b.shape), b.data_offset, b.n_bytes, b.n_elements):
            out.append(f"tensor {a.name}: header differs")
        elif a.data.dtype != b.data.dtype or a.data.shape != b.data.shape or a.data.tobytes() != b.data.tobytes():
            out.append(f"tensor {a.name}: data differs")
    return out


def test_smollm2_metadata_and_tensors_equal_gguf_py(smollm2_path, smollm2_ref):
    got = read_gguf(smollm2_path)
    assert differences(smollm2_ref, got) == []
    assert len(got.tensors) == 272 and len(got.fields["tokenizer.ggml.tokens"]) == 49152
    assert len(got.fields["tokenizer.ggml.merges"]) == 48900


def test_smollm2_strings_take_the_bulk_path(smollm2_path, monkeypatch):
    """No string array of the shipped file needs the string-by-string path."""
    def refuse(cur, n, what):
        raise AssertionError(f"{what}: {n} strings read one at a time")

    monkeypatch.setattr(gguf_read, "_strings_stepwise", refuse)
    assert len(read_gguf(smollm2_path).fields["tokenizer.ggml.tokens"]) == 49152


def test_tensors_are_read_only_views_of_the_map(smollm2_path):
    from lmtail.kernels.quant.gemm_q import QuantWeight

    got = read_gguf(smollm2_path)
    with open(smollm2_path, "rb") as f:
        for t in got.tensors[::17] + got.tensors[-1:]:
            f.seek(t.data_offset)
            assert f.read(t.n_bytes) == t.data.tobytes(), t.name
            assert not t.data.flags.owndata and not t.data.flags.writeable, t.name
    embed = got.tensor_map()["token_embd.weight"]
    w = QuantWeight.from_gguf(embed)  # the head's blocks: a view, not a copy
    assert w.data.data_ptr() == embed.data.ctypes.data and w.shape == (49152, 576)


# ---------------------------------------------------------------------------------------
# written files: every value type, the strings the bulk path cannot prove
# ---------------------------------------------------------------------------------------
EDGE_STRINGS = ["", "a", "", "x\x00y", "é" * 40000, "\x00", "end"]  # empty, NUL, a 80 kB string


def write_file(path, *, strings=None, seed=0) -> str:
    """A GGUF (gguf-py's writer) with every scalar type, numeric arrays, string arrays
    (`strings`: one more), and F32 / F16 / I32 / Q8_0 / BF16 tensors."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    for i, (vt, val) in enumerate([(V.UINT8, 200), (V.INT8, -3), (V.UINT16, 60000), (V.INT16, -300),
                                   (V.UINT32, 4_000_000_000), (V.INT32, -7), (V.FLOAT32, 0.1),
                                   (V.UINT64, 2**63 + 5), (V.INT64, -(2**40)), (V.FLOAT64, 1 / 3),
                                   (V.BOOL, True), (V.STRING, "naïve ☃")]):
        w.add_key_value(f"t.scalar{i}", val, vt)
    w.add_key_value("t.f32s", [float(x) for x in rng.standard_normal(33)], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.i16s", [int(x) for x in rng.integers(-30000, 30000, 9)], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("t.u64s", [2**64 - 1, 0, 5], V.ARRAY, sub_type=V.UINT64)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_array("t.words", ["Ġthe", "東京", "😀", "<|im_end|>"] * 50)
    if strings is not None:
        w.add_key_value("t.strings", strings, V.ARRAY, sub_type=V.STRING)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((5, 7)).astype(np.float16))
    w.add_tensor("i32", rng.integers(-9, 9, (4,)).astype(np.int32))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("bf16", rng.integers(0, 255, (2, 16), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def random_strings(rng: random.Random, n: int) -> list[str]:
    pool = "abcxyzĠĊ0123456789 ._-éü東京😀<|>"
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 300 if i % 97 == 0 else 12)))
            for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_written_file_equals_gguf_py(tmp_path, seed, monkeypatch):
    """Random non-empty strings: the bulk path, nothing read one string at a time."""
    path = write_file(tmp_path / "a.gguf", strings=random_strings(random.Random(seed), 3001), seed=seed)
    monkeypatch.setattr(gguf_read, "_strings_stepwise", lambda cur, n, what: pytest.fail(f"{what} stepwise"))
    assert differences(gguf.GGUFReader(path), read_gguf(path)) == []


@pytest.mark.parametrize("strings", [EDGE_STRINGS, ["", ""], ["only"], ["a" * 65536, "b"], ["ok", "bad\x00"]])
def test_strings_the_scan_cannot_prove_equal_gguf_py(tmp_path, strings):
    path = write_file(tmp_path / "e.gguf", strings=strings)
    got = read_gguf(path)
    assert got.fields["t.strings"] == strings
    assert differences(gguf.GGUFReader(path), got) == []


def red(path) -> bool:
    """Whether read_gguf(path) differs from gguf-py (or fails where gguf-py does not)."""
    try:
        got = read_gguf(path)
    except (ValueError, IndexError):
        return True
    return differences(gguf.GGUFReader(path), got) != []


def test_planted_no_chain_proof_goes_red(tmp_path, monkeypatch):
    """Planted: the scan's starts taken unproved: six NULs inside a string look like a length
    prefix, so a false start is taken (and the NUL count still matches): red."""
    path = write_file(tmp_path / "p.gguf", strings=["hello", "ab" + "\x00" * 6 + "cd", "x", "last"])
    assert not red(path)
    monkeypatch.setattr(gguf_read, "_chain_ok", lambda starts, lengths: True)
    assert red(path)


def test_planted_no_nul_count_goes_red(tmp_path, monkeypatch):
    """Planted: the joined strings split without checking the count of NULs: a NUL inside a
    string (its starts all proved) splits it in two: red."""
    path = write_file(tmp_path / "n.gguf", strings=["ok", "bad\x00", "z"])
    assert not red(path)
    monkeypatch.setattr(gguf_read, "_split", lambda joined, n: joined.decode().split("\x00")[1:n + 1])
    assert red(path)


def test_planted_separator_off_by_one_goes_red(tmp_path, monkeypatch):
    """Planted: the strings shifted by one (a separator lost): red."""
    path = write_file(tmp_path / "s.gguf", strings=random_strings(random.Random(5), 50))
    real = gguf_read._strings_bulk

    def shifted(cur, n):
        out = real(cur, n)
        return None if out is None else out[1:] + [""]

    monkeypatch.setattr(gguf_read, "_strings_bulk", shifted)
    assert red(path)


# ---------------------------------------------------------------------------------------
# bad files: one ValueError naming what is wrong
# ---------------------------------------------------------------------------------------
def header(version=3, n_tensors=0, n_kv=1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


@pytest.mark.parametrize("content, match", [
    (b"", "not a GGUF file .it has 0 bytes"),
    (b"GGML" + bytes(40), "magic must be b'GGUF'; got b'GGML'"),
    (header(version=1) + bytes(20), r"version must be one of \(2, 3\).*got 1"),
    (header() + kv_string("a", "b")[:-1], "truncated: a needs 1 bytes"),
    (header(n_kv=2) + kv_string("a", "b") + kv_string("a", "c"), "key 'a' appears twice"),
    (header() + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 13) + bytes(8),
     "value type must be one of 0-12; got 13"),
    (header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 9, 1) + bytes(8),
     "array item type must be a number or a string; got 9"),
    (header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 2) + b"\xff\xfe", "k must be UTF-8"),
    (header() + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**40) + bytes(64),
     "truncated: k's 1099511627776 strings needs 8796093022208 bytes"),
])
def test_bad_files_refused(tmp_path, content, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        read_gguf(p)


def test_tensor_past_the_end_refused(tmp_path):
    path = write_file(tmp_path / "t.gguf")
    raw = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:-40])
    with pytest.raises(ValueError, match="tensor 'bf16': data .* past the file's"):
        read_gguf(cut)


# ---------------------------------------------------------------------------------------
# the tokenizer: the same ids as one built the old way from gguf-py's lists
# ---------------------------------------------------------------------------------------
def old_tokenizer(ref):
    """The pre-issue-32 construction, verbatim in substance: gguf-py's lists, Python loops."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = ref.fields["tokenizer.ggml.tokens"].contents()
    merges = ref.fields["tokenizer.ggml.merges"].contents()
    types = ref.fields["tokenizer.ggml.token_type"].contents()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == 3])
    return tok


TEXTS = ["Hi", "Hello, world!", "  leading spaces\tand\ttabs\n\nnewlines  ", "3.14159 x 2024 = 6,367.9",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "naïve café, Straße, Ørsted",
         "東京は日本の首都です。", "emoji 😀🎉👍🏽 done", "def f(x):\n    return x ** 2  # square\n",
         "<|endoftext|><|endoftext|>", "", " ", "a" * 500, "The quick brown fox jumps over the lazy dog."]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tokenizer_ids_equal_the_old_build(smollm2_path, smollm2_ref, seed):
    from lmtail.model.gguf_loader import _read_tokenizer

    new, old = _read_tokenizer(read_gguf(smollm2_path)), old_tokenizer(smollm2_ref)
    rng = random.Random(seed)
    texts = TEXTS + ["".join(rng.choice("ab 1\n东😀<|im_end|>éĠ.,'\"") for _ in range(rng.randint(1, 200)))
                     for _ in range(40)]
    for text in texts:
        ids = new.encode(text)
        assert ids == old.encode(text, add_special_tokens=False).ids, text
        assert new.decode(ids, skip_special=False) == old.decode(ids, skip_special_tokens=False), text
    assert new.special_ids == {i for i, ty in enumerate(smollm2_ref.fields["tokenizer.ggml.token_type"].contents())
                               if ty == 3}
    assert new.vocab_size == old.get_vocab_size(with_added_tokens=True)


def test_build_tokenizer_errors():
    from lmtail.model.tokenizer import build_tokenizer

    base = dict(tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>", "a", "b", "ab"], token_types=[3, 3, 3, 1, 1, 1],
                bos_id=0, eos_id=1)
    with pytest.raises(ValueError, match=r"each merge must be 'left right'; got 'a b c'"):
        build_tokenizer(**base, merges=["a b", "a b c"])
    with pytest.raises(ValueError, match=r"each merge must be 'left right'; got 'ab'"):
        build_tokenizer(**base, merges=["ab"])
    with pytest.raises(ValueError, match=r"token_type must have one entry per token \(6\); got shape \(5,\)"):
        build_tokenizer(**{**base, "token_types": [1] * 5}, merges=[])
    with pytest.raises(ValueError, match="tokens must be unique; got 1 duplicates"):
        build_tokenizer(**{**base, "tokens": base["tokens"][:-1] + ["a"]}, merges=[])
    tok = build_tokenizer(**base, merges=["a b"])
    assert tok.encode("ab") == [5] and tok.special_ids == {0, 1, 2}


# ---------------------------------------------------------------------------------------
# cold start: load_model(weights="file") in a fresh process
# ---------------------------------------------------------------------------------------
LOAD_LIMIT_S = 1.0  # the target is 0.5 s (issue 32); 2x for a loaded shared machine; it was ~4 s

LOAD = """
import time
from lmtail.model.gguf_loader import load_model
t0 = time.perf_counter()
load_model(weights="file")
print(time.perf_counter() - t0)
"""


def test_load_model_file_is_fast_in_a_fresh_process(smollm2_path):
    """The best of 2 fresh processes: the import of lmtail is outside the time, gguf's and the
    parse inside (what `lmtail generate` pays after torch)."""
    best = min(float(subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                                    check=True, timeout=120).stdout) for _ in range(2))
    assert best < LOAD_LIMIT_S, f"load_model(weights='file') took {best:.2f} s"
