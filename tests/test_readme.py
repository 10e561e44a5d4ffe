"""The README's API example runs as written and does what it says."""
import re
from pathlib import Path

import torch


def test_readme_api_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## The API\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.tokens.shape == (4,) and out.tokens.dtype == torch.int64
    assert out.topk_values.shape == (4, 256) and out.logits.shape == (4, 25136)
    assert out.tokens[0] == out.topk_indices[0, 0]  # row 0 is greedy
    assert out.truncated.dtype == torch.bool
    same = scope["same"]  # the README says config= gives the same outputs as the keywords
    for name in ("tokens", "logprobs", "topk_values", "topk_indices", "truncated", "logits"):
        a, b = getattr(out, name), getattr(same, name)
        view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.view(view), b.view(view)), name
