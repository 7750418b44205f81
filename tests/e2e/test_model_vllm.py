"""A made tiny model runs in vLLM's CPU engine and greedy-decodes exactly as transformers does
(same weights, same tokenizer): what the rollout workers sample is what the trainer scores."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from resilient_rl.spec import TinyModelInit
from resilient_rl.workers.model_init import make_tiny_model

CHARS = "0123456789:=+copyrevsa "
# One with a space: vLLM must tokenize text prompts exactly as the trainer's tokenizer does.
PROMPTS = ["copy:123=", "reverse:9 80=", "12+7="]
MAX_NEW = 8
EOS = 1


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_vllm_greedy_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default would claim a large share of RAM
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: one start, nothing left running
    }.items():
        monkeypatch.setenv(key, value)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams  # imported here: a slow import other tests should not pay

    folder = make_tiny_model(tmp_path / "model", TinyModelInit(), CHARS)
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected_ids, expected_logprobs = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = _until_eos(out.sequences[0, ids.shape[1] :].tolist())
        expected_ids.append(new)
        logps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new, strict=False)]
        expected_logprobs.append(logps)

    llm = LLM(model=str(folder), enforce_eager=True, dtype="float32", seed=0)
    try:
        results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1))
    finally:
        del llm
        gc.collect()

    for prompt, result, want_ids, want_logps in zip(PROMPTS, results, expected_ids, expected_logprobs, strict=True):
        assert list(result.prompt_token_ids) == tok(prompt).input_ids, prompt
        sample = result.outputs[0]
        got = _until_eos(list(sample.token_ids))
        assert got == want_ids, f"{prompt!r}: vLLM {got} != transformers {want_ids}"
        got_logps = [step[t].logprob for step, t in zip(sample.logprobs, got, strict=False)]
        assert got_logps == pytest.approx(want_logps, abs=1e-3), prompt
        # vLLM's detokenizer concatenates characters too (no spaces inserted, specials skipped).
        assert sample.text == tok.decode(got, skip_special_tokens=True)
