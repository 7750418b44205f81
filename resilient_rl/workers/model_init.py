"""Make a tiny, randomly initialised Qwen2 policy model with a character-level tokenizer.

Used by ``model.init`` jobs (and ``rrl init-model``) so everything can run offline:
no weights are downloaded, the model is built from :class:`~resilient_rl.spec.TinyModelInit`.

The folder written is a plain Hugging Face model folder (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` ...), loadable by
``AutoModelForCausalLM`` / ``AutoTokenizer`` and by vLLM, plus a marker file
(:data:`MARKER`) recording the parameters it was made from, which makes
:func:`make_tiny_model` idempotent.

Worker-side module: imports torch and transformers at the top.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import pre_tokenizers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from checkpoints.journal import fsync_dir

from ..naming import MODEL_MARKER

if TYPE_CHECKING:  # the model is built from any object with these fields (bench/gpu_check.py has no pydantic)
    from ..spec import TinyModelInit

EOS = "<eos>"
#: The one special token, id 0; characters follow. Padding reuses it (masked out anyway):
#: a separate ``<pad>`` / ``<unk>`` would be sampleable tokens that decode to nothing, and a
#: policy learns to fill completions with them instead of learning to stop (seen: reward
#: plateaued at ~0.5 on the copy task with completions full of invisible ``<pad>``s).
TOKENIZER_SPECIALS: tuple[str, ...] = (EOS,)
#: Written last into a finished model folder; holds the parameters it was made from.
MARKER = MODEL_MARKER
#: Bump when the folder layout changes, so older folders are not taken as complete.
_FORMAT = 2
MAX_POSITIONS = 512


def _params(init: TinyModelInit, vocab_chars: str) -> dict[str, Any]:
    return {"format": _FORMAT, "init": init.model_dump(mode="json"), "vocab_chars": vocab_chars}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level(ch: str) -> str:
    # The ByteLevel pre-tokenizer's own mapping (GPT-2's bytes_to_unicode): " " -> "Ġ", "\n" -> "Ċ".
    ((piece, _),) = _BYTE_LEVEL.pre_tokenize_str(ch)
    return piece


def build_vocab(vocab_chars: str) -> dict[str, int]:
    """Token -> id: the :data:`TOKENIZER_SPECIALS` (id 0), then one token per character of
    ``vocab_chars`` in order (ids 1..). Tokens are byte-level spellings (a space is ``"Ġ"``).

    Raises ``ValueError`` when ``vocab_chars`` is empty, repeats a character (ids must be
    unambiguous) or holds a non-ASCII character (its UTF-8 bytes would be several tokens).
    """
    if not vocab_chars:
        raise ValueError("vocab_chars must hold at least one character")
    if len(set(vocab_chars)) != len(vocab_chars):
        dupes = sorted({c for c in vocab_chars if vocab_chars.count(c) > 1})
        raise ValueError(f"vocab_chars repeats characters: {dupes!r}")
    if not vocab_chars.isascii():
        raise ValueError(f"vocab_chars must be ASCII, got {sorted(c for c in vocab_chars if not c.isascii())!r}")
    return {tok: i for i, tok in enumerate([*TOKENIZER_SPECIALS, *map(_byte_level, vocab_chars)])}


def build_tokenizer(vocab_chars: str) -> Qwen2Tokenizer:
    """A character-level fast tokenizer: every character is one token; decode concatenates, no spaces.

    Why a Qwen2Tokenizer (a byte-level BPE with no merges) and not a WordLevel ``tokenizers``
    pipeline: for ``model_type: qwen2`` folders, transformers 5's ``AutoTokenizer`` (and so vLLM)
    ignores the pipeline in ``tokenizer.json`` and rebuilds a Qwen2Tokenizer from its vocab. A
    WordLevel tokenizer would silently turn into one that drops spaces. Building the very class
    every loader rebuilds makes the saved tokenizer and every reload tokenize identically.

    Contract: ``encode`` adds no bos/eos; ``decode(encode(s)) == s`` for ``s`` over ``vocab_chars``
    plus the special token (the text ``"<eos>"`` is the eos token, also used as padding).
    Characters outside ``vocab_chars`` are dropped (Qwen2's BPE has no unknown token).
    """
    return Qwen2Tokenizer(
        vocab=build_vocab(vocab_chars),
        merges=[],
        unk_token=None,
        eos_token=EOS,
        pad_token=EOS,
        bos_token=None,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def build_model(init: TinyModelInit, vocab_size: int, pad_id: int, eos_id: int) -> Qwen2ForCausalLM:
    """A float32 Qwen2ForCausalLM with random weights drawn from ``init.seed`` (same seed, same weights).

    The global torch RNG is left as it was.
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        dtype="float32",
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    # fork_rng: seeding must not disturb the caller's RNG stream (e.g. a trainer's sampling).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init.seed)
        model = Qwen2ForCausalLM(config).float()  # float32 even if the caller changed the default dtype
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    return model.eval()


def _fsync_tree(folder: Path) -> None:
    # The rename is atomic, but without fsync a power loss could persist the rename before the data.
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def make_tiny_model(out_dir: str | Path, init: TinyModelInit, vocab_chars: str) -> Path:
    """Write a tiny random Qwen2 model and its character tokenizer to ``out_dir``; return ``out_dir``.

    Vocabulary: :data:`TOKENIZER_SPECIALS` (ids 0..2) then ``vocab_chars`` (ids 3..).

    Idempotent: when ``out_dir`` already holds a complete model made from the same ``init`` and
    ``vocab_chars`` it is returned untouched. Atomic: the model is written to a temporary sibling
    folder and moved into place with ``os.replace``, so ``out_dir`` is either absent or complete.
    Concurrent callers with the same parameters are safe (the loser discards its copy).

    Raises ``FileExistsError`` when ``out_dir`` exists but holds something else (a model made
    from other parameters, or any non-empty folder without the marker): it is never overwritten.
    """
    out = Path(out_dir)
    want = _params(init, vocab_chars)
    vocab = build_vocab(vocab_chars)  # validate before touching the disk
    if _read_marker(out) == want:
        return out
    _refuse_existing(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tokenizer = build_tokenizer(vocab_chars)
        model = build_model(init, len(vocab), pad_id=vocab[EOS], eos_id=vocab[EOS])
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # The marker goes last: its presence means every other file is complete.
        (tmp / MARKER).write_text(json.dumps(want, sort_keys=True, indent=1) + "\n")
        _fsync_tree(tmp)
        try:
            os.replace(tmp, out)  # atomic; replaces only an absent or empty folder
        except OSError:
            # Lost a race with another maker, or a folder appeared meanwhile.
            if _read_marker(out) == want:
                return out
            raise
        fsync_dir(out.parent)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _refuse_existing(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    if _read_marker(out) is not None:
        raise FileExistsError(f"{out}: holds a tiny model made from other parameters; remove it or use another folder")
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: exists, is not empty and is not a model made by make_tiny_model")
