"""Rollout engines: one interface, two implementations (vLLM, HF transformers).

Both sample every completion with its own seed (derived from ``(seed, step,
prompt, sample)`` by the caller), so a shard regenerated elsewhere after a
fault gives the same tokens, and both load new weights in place between
shards. Imported only inside rollout worker actors (heavy imports).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Completion:
    """One sampled completion: token ids (EOS included when generated) and their logprobs."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int


class Engine(Protocol):
    """A generation engine holding one policy version at a time."""

    def generate(self, prompts: list[str], seeds: list[int], sampling: Sampling) -> list[Completion]:
        """One completion per (prompt, seed) pair, in order."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the policy weights in place; later calls to generate use them."""
        ...


class HFEngine:
    """transformers model with a small sampling loop (per-row torch generators, KV cache)."""

    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.eval()
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    @torch.no_grad()
    def generate(self, prompts: list[str], seeds: list[int], sampling: Sampling) -> list[Completion]:
        enc = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out: list[Completion] = []
        # group rows by prompt length so no padding is needed (prompts of one task are short)
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(enc):
            by_len.setdefault(len(ids), []).append(i)
        results: dict[int, Completion] = {}
        for rows in by_len.values():
            ids = torch.tensor([enc[i] for i in rows])
            gens = [torch.Generator().manual_seed(seeds[i]) for i in rows]
            toks, lps = self._sample(ids, gens, sampling)
            for j, i in enumerate(rows):
                results[i] = Completion(
                    enc[i], toks[j], lps[j], self.tokenizer.decode(toks[j], skip_special_tokens=True)
                )
        out = [results[i] for i in range(len(prompts))]
        return out

    def _sample(
        self, ids: torch.Tensor, gens: list[torch.Generator], s: Sampling
    ) -> tuple[list[list[int]], list[list[float]]]:
        b = ids.shape[0]
        done = [False] * b
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        past = None
        cur = ids
        for _ in range(s.max_tokens):
            o = self.model(input_ids=cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)  # logprobs of the unscaled policy (as vLLM reports)
            nxt = torch.empty(b, dtype=torch.long)
            for r in range(b):
                if s.temperature == 0:
                    nxt[r] = int(torch.argmax(logits[r]))
                    continue
                probs = torch.softmax(logits[r] / s.temperature, dim=-1)
                if s.top_p < 1.0:
                    sp, si = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sp, 0) - sp < s.top_p
                    probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
                nxt[r] = int(torch.multinomial(probs, 1, generator=gens[r]))
            for r in range(b):
                if done[r]:
                    continue
                t = int(nxt[r])
                toks[r].append(t)
                lps[r].append(float(logp[r, t]))
                if t == self.eos:
                    done[r] = True
            if all(done):
                break
            cur = nxt.unsqueeze(1)
        return toks, lps

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict, strict=True)


def _reload(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    # runs inside vLLM's worker (in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
    worker.reload_weights(weights_iterator=iter(weights))


class VLLMEngine:
    """vLLM (CPU build here, upstream on GPU). One engine per worker, reused for every shard."""

    def __init__(self, model_dir: str, dtype: str = "float32", kv_cache_gib: float = 1.0, seed: int = 0) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gib))))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=model_dir, enforce_eager=True, dtype=dtype, seed=seed, gpu_memory_utilization=0.3)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], seeds: list[int], sampling: Sampling) -> list[Completion]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=seed,
                logprobs=0,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = []
            for t, d in zip(ids, c.logprobs or [], strict=False):
                lps.append(float(d[t].logprob) if t in d else float("nan"))
            result.append(Completion(list(o.prompt_token_ids), ids, lps, c.text))
        return result

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(_reload, args=(list(state_dict.items()),))
        self.llm.reset_prefix_cache()


def make_engine(kind: str, model_dir: str, dtype: str, kv_cache_gib: float, seed: int) -> Engine:
    if kind == "vllm":
        return VLLMEngine(model_dir, dtype, kv_cache_gib, seed)
    return HFEngine(model_dir, dtype)
