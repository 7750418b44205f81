"""make_tiny_model: the folder loads with the stock Auto classes, tokenizes per character,
is reproducible from its seed, and is written idempotently and atomically."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing may be fetched

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from resilient_rl.spec import TinyModelInit
from resilient_rl.workers import model_init
from resilient_rl.workers.model_init import MARKER, TOKENIZER_SPECIALS, build_tokenizer, make_tiny_model

CHARS = "0123456789:=+-copyrevsadtih \n"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelInit(), CHARS)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_folder_layout(made: Path) -> None:
    names = {p.name for p in made.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    assert not [n for n in os.listdir(made.parent) if n.startswith(".")], "temp folders left behind"


def test_auto_tokenizer_round_trips_characters(made: Path) -> None:
    tok = AutoTokenizer.from_pretrained(made)
    ids = tok("copy:123=").input_ids
    assert len(ids) == len("copy:123=")  # one token per character, no bos/eos added
    assert tok.decode(ids) == "copy:123="
    for text in ["reverse: 4 5\n=", "  a", "\n\n", "<eos>"]:
        assert tok.decode(tok(text).input_ids) == text


def test_vocab_ids(made: Path) -> None:
    tok = AutoTokenizer.from_pretrained(made)
    assert [tok.convert_tokens_to_ids(t) for t in TOKENIZER_SPECIALS] == [0]
    # one special token: padding is eos, and nothing decodes to an invisible, sampleable token
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 0, None)
    assert len(tok) == 1 + len(CHARS)
    assert tok(CHARS).input_ids == list(range(1, 1 + len(CHARS)))
    assert len(tok) == len(TOKENIZER_SPECIALS) + len(CHARS)
    assert tok("1<eos>").input_ids == [2, 0]  # special tokens are matched whole
    assert tok.decode([2, 0], skip_special_tokens=True) == "1"


def test_every_loader_tokenizes_alike(made: Path) -> None:
    """The in-memory tokenizer, AutoTokenizer (what vLLM uses) and the generic fast class agree,
    including on spaces, newlines and characters outside the vocabulary (dropped)."""
    loaders = [
        build_tokenizer(CHARS),
        AutoTokenizer.from_pretrained(made),
        PreTrainedTokenizerFast.from_pretrained(made),
    ]
    for text in ["copy: 1 2\n3=<eos>", "xyz 7", "<eos>q"]:
        encodings = [t(text).input_ids for t in loaders]
        assert encodings[0] == encodings[1] == encodings[2], text
        assert len({t.decode(encodings[0]) for t in loaders}) == 1
    assert loaders[1]("zx1").input_ids == [2]  # "z", "x" are not in CHARS


def test_model_config_and_generation(made: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(made)
    cfg = model.config
    init = TinyModelInit()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.vocab_size == len(TOKENIZER_SPECIALS) + len(CHARS)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (
        init.hidden_size,
        init.num_layers,
        init.intermediate_size,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (init.num_heads, init.num_kv_heads)
    assert cfg.max_position_embeddings == 512 and cfg.tie_word_embeddings is False
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (0, 0, None)

    tok = AutoTokenizer.from_pretrained(made)
    prompt = tok("copy:12=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and 8 < out.shape[1] <= 12
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path, made: Path) -> None:
    rng_before = torch.random.get_rng_state()
    again = make_tiny_model(tmp_path / "again", TinyModelInit(), CHARS)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "the caller's RNG was disturbed"
    a, b = _weights(made), _weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = _weights(make_tiny_model(tmp_path / "other", TinyModelInit(seed=1), CHARS))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_idempotent_returns_untouched(made: Path) -> None:
    stamps = {p.name: p.stat().st_mtime_ns for p in made.iterdir()}
    assert make_tiny_model(made, TinyModelInit(), CHARS) == made
    assert {p.name: p.stat().st_mtime_ns for p in made.iterdir()} == stamps
    assert json.loads((made / MARKER).read_text())["vocab_chars"] == CHARS


def test_refuses_to_overwrite_something_else(tmp_path: Path, made: Path) -> None:
    with pytest.raises(FileExistsError, match="other parameters"):
        make_tiny_model(made, TinyModelInit(seed=7), CHARS)
    with pytest.raises(FileExistsError, match="other parameters"):
        make_tiny_model(made, TinyModelInit(), CHARS + "z")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny_model(busy, TinyModelInit(), CHARS)
    assert (busy / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_tiny_model(empty, TinyModelInit(), CHARS) / MARKER).exists()


def test_crash_leaves_no_half_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "m"

    def crash(folder: Path) -> None:
        assert (folder / "model.safetensors").exists()  # the files were written ...
        raise RuntimeError("killed")  # ... but the crash comes before the move into place

    monkeypatch.setattr(model_init, "_fsync_tree", crash)
    with pytest.raises(RuntimeError, match="killed"):
        make_tiny_model(out, TinyModelInit(), CHARS)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert (make_tiny_model(out, TinyModelInit(), CHARS) / MARKER).exists()


def test_concurrent_maker_wins_the_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishes the same model between our check and our move: we return its copy."""
    out = tmp_path / "m"
    real_fsync = model_init._fsync_tree

    def other_process_finishes_first(folder: Path) -> None:
        monkeypatch.setattr(model_init, "_fsync_tree", real_fsync)
        make_tiny_model(out, TinyModelInit(), CHARS)
        real_fsync(folder)

    monkeypatch.setattr(model_init, "_fsync_tree", other_process_finishes_first)
    assert make_tiny_model(out, TinyModelInit(), CHARS) == out
    winner_stamp = (out / MARKER).stat().st_mtime_ns
    assert os.listdir(tmp_path) == ["m"]
    assert make_tiny_model(out, TinyModelInit(), CHARS) == out
    assert (out / MARKER).stat().st_mtime_ns == winner_stamp


@pytest.mark.parametrize(("chars", "why"), [("", "at least one"), ("0110", "repeats"), ("01é", "ASCII")])
def test_bad_vocab_chars(tmp_path: Path, chars: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        make_tiny_model(tmp_path / "m", TinyModelInit(), chars)
    assert not (tmp_path / "m").exists()
