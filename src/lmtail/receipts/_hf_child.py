"""Child process of the optional HF arm: Hugging Face transformers' own float32 forward of
a GGUF file. Runs in the benchmark-only venv (transformers + accelerate), never imports lmtail.

    python _hf_child.py IN.json OUT.npz
IN.json: {"gguf": path, "passages": [{"ids": [...], "positions": [...]}, ...]}
OUT.npz: logits_<i> [len(positions), V] float32 for passage i (one causal forward of its ids).
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(src: str, dst: str) -> int:
    spec = json.loads(Path(src).read_text())
    gguf = Path(spec["gguf"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    out = {}
    with torch.no_grad():
        for i, p in enumerate(spec["passages"]):
            ids = torch.tensor([p["ids"]], dtype=torch.int64)  # [1, T]
            logits = model(input_ids=ids).logits[0]  # [T, V] fp32
            out[f"logits_{i}"] = logits[p["positions"]].float().numpy()
    np.savez(dst, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
