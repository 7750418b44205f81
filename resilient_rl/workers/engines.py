"""Rollout engines: one interface, two implementations (vLLM, HF transformers).

Both sample every completion with its own seed (derived from ``(seed, step,
prompt, sample)`` by the caller), so a shard regenerated elsewhere after a
fault gives the same tokens, and both load new weights in place between
shards. Both *stream*: :meth:`Engine.stream` yields each completion as soon as it
is finished (vLLM's engine is stepped, not ``LLM.generate``, which returns only
once every prompt is done), so a worker journals finished prompt groups while the
rest are still generating, and stops at once when it is preempted. Imported only
inside rollout worker actors (heavy imports).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


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

    def stream(
        self, prompts: list[str], seeds: list[int], sampling: Sampling, stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[int, Completion]]:
        """``(position, completion)`` for every (prompt, seed) pair, each as soon as it is finished
        (any order). Closing the iterator early stops the generation of the rest; so does
        ``stop()`` turning true (asked after every decoding step): the iterator then ends."""
        ...

    def load_weights(self, weights: Weights) -> None:
        """Replace the policy weights in place from a state dict or ``(name, tensor)`` pairs
        (consumed as they come: see ``transport.fetch``); later calls to generate use them."""
        ...


class HFEngine:
    """transformers model with a small sampling loop (per-row torch generators, KV cache)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)  # the model's; sampling (per-row CPU generators) stays on the CPU
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    def generate(self, prompts: list[str], seeds: list[int], sampling: Sampling) -> list[Completion]:
        return _in_order(self.stream(prompts, seeds, sampling), len(prompts))

    def stream(
        self, prompts: list[str], seeds: list[int], sampling: Sampling, stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[int, Completion]]:
        enc = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # group rows by prompt length so no padding is needed (prompts of one task are short)
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(enc):
            by_len.setdefault(len(ids), []).append(i)
        for rows in by_len.values():
            ids = torch.tensor([enc[i] for i in rows])
            gens = [torch.Generator().manual_seed(seeds[i]) for i in rows]
            if stop is not None and stop():
                return
            for j, toks, lps in self._sample(ids, gens, sampling, stop):
                i = rows[j]
                yield i, Completion(enc[i], toks, lps, self.tokenizer.decode(toks, skip_special_tokens=True))

    def _sample(
        self, ids: torch.Tensor, gens: list[torch.Generator], s: Sampling, stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[int, list[int], list[float]]]:
        """``(row, tokens, logprobs)`` of each row as it ends (EOS, or ``max_tokens`` for the rest);
        nothing more once ``stop()`` is true."""
        b = ids.shape[0]
        done = [False] * b
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        past = None
        cur = ids.to(self.device)
        for _ in range(s.max_tokens):
            with torch.no_grad():
                o = self.model(input_ids=cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1, :].float().cpu()
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
                    yield r, toks[r], lps[r]
            if all(done) or (stop is not None and stop()):
                return
            cur = nxt.unsqueeze(1).to(self.device)
        for r in range(b):
            if not done[r]:
                yield r, toks[r], lps[r]

    @torch.no_grad()
    def load_weights(self, weights: Weights) -> None:
        live = self.model.state_dict()
        seen: set[str] = set()
        for name, t in _pairs(weights):
            if name not in live:
                raise KeyError(f"load_weights: {name!r} is not a weight of this model")
            if live[name].shape != t.shape:
                raise ValueError(f"load_weights: {name} is {list(t.shape)}, the model's is {list(live[name].shape)}")
            live[name].copy_(t)  # to the model's device
            seen.add(name)
        missing = sorted(set(live) - seen)
        if missing:  # a partial update would mix two policy versions
            raise KeyError(f"load_weights: {len(missing)} weights missing, e.g. {missing[:3]}")


def _in_order(stream: Iterator[tuple[int, Completion]], n: int) -> list[Completion]:
    got = dict(stream)
    return [got[i] for i in range(n)]


def _pairs(weights: Weights) -> Iterable[tuple[str, torch.Tensor]]:
    return weights.items() if isinstance(weights, Mapping) else weights


def _reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
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
        self._serial = 0  # request ids of one stream: rrl{serial}-{position}

    def generate(self, prompts: list[str], seeds: list[int], sampling: Sampling) -> list[Completion]:
        return _in_order(self.stream(prompts, seeds, sampling), len(prompts))

    def stream(
        self, prompts: list[str], seeds: list[int], sampling: Sampling, stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[int, Completion]]:
        """The engine stepped as ``LLM.generate`` steps it, but each finished request handed out
        at once; requests still running when the iterator is closed are aborted."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._serial += 1
        tag = f"rrl{self._serial}-"
        pending: set[str] = set()
        try:
            for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
                params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                        max_tokens=sampling.max_tokens, seed=seed, logprobs=0)  # fmt: skip
                params.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(tag + str(i), prompt, params)
                pending.add(tag + str(i))
            while pending and not (stop is not None and stop()):
                for o in engine.step():
                    if not o.finished or o.request_id not in pending:
                        continue
                    pending.discard(o.request_id)
                    c = o.outputs[0]
                    ids = list(c.token_ids)
                    lps = [float(d[t].logprob) if t in d else float("nan")
                           for t, d in zip(ids, c.logprobs or [], strict=False)]  # fmt: skip
                    yield int(o.request_id[len(tag) :]), Completion(list(o.prompt_token_ids or []), ids, lps, c.text)
        finally:
            if pending:  # closed early (a preemption) or failed: the rest must not run on in the engine
                engine.abort_request(sorted(pending))

    def load_weights(self, weights: Weights) -> None:
        pairs = _pairs(weights)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            pairs = list(pairs)  # the engine runs in another process: its arguments are pickled
        # in-process, the iterator is consumed as vLLM loads: one bucket in memory at a time
        self.llm.collective_rpc(_reload, args=(pairs,))
        self.llm.reset_prefix_cache()


def make_engine(kind: str, model_dir: str, dtype: str, kv_cache_gib: float, seed: int) -> Engine:
    if kind == "vllm":
        return VLLMEngine(model_dir, dtype, kv_cache_gib, seed)
    return HFEngine(model_dir, dtype)
