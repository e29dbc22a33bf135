"""A seeded chat workload in the Mooncake trace shape, so a replay needs no trace file.

Why this exists
    ``kvtier replay`` must answer "what would kvtier save on traffic like mine" on any machine,
    also without a trace at hand. This generator produces the kind of traffic prefix caching is
    for: multi-turn conversations whose every turn repeats the whole history, opened by one of a
    few shared system prompts (some far more popular than others), some turns carrying a long
    document, conversations arriving over time and interleaving. The records are
    ``kvtier.replay.trace.Request`` objects, exactly what ``load_trace`` reads from a Mooncake file
    (``write_trace`` writes them as one), so every replay path treats both the same.

How block ids are assigned (the Mooncake convention)
    One id per ``block_tokens`` tokens of the prompt, the last partial block included. Ids are
    chained: two prompts share an id exactly when everything up to the end of that block is the
    same. Here that means: the full blocks of a system prompt are shared by every conversation
    opened with it; the full blocks of a conversation's prompt are shared by all its later turns
    (each turn is history + answer + new user message); a block that was partial (the prompt's
    tail) gets more tokens in the next turn, so it gets a new id. Nothing else is shared, except:

Two knobs make other shapes of traffic, so a policy is judged on more than one (both 0 by default,
and then the generator draws exactly the numbers it drew before they existed):

- ``shared_documents``: a conversation's first turn that carries a document carries one of these few
  documents (Zipf-like popularity), placed right after the system prompt, so its full blocks are
  shared by every conversation that opens with the same system prompt and document: "a few long
  documents read many times".
- ``one_off_requests``: prompts that share nothing with anything (a scan: batch jobs, one-shot
  API calls), arriving uniformly over the span of the conversations' arrivals.

Same seed, same parameters, same requests: the generator uses only its own ``random.Random``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

from kvtier.replay.trace import Request


@dataclass(frozen=True)
class ChatWorkload:
    """Knobs of the generated traffic. Lengths are in tokens, times in milliseconds."""

    conversations: int = 400
    system_prompts: int = 6
    mean_turns: float = 4.0  # turns per conversation: 1 + geometric, this mean
    block_tokens: int = 512  # tokens per hash id, as in Mooncake traces
    system_prompt_tokens: tuple[int, int] = (1024, 6144)  # uniform range of a system prompt's length
    user_tokens: tuple[int, int] = (64, 1536)  # range of one user message
    output_tokens: tuple[int, int] = (32, 768)  # range of one answer
    document_chance: float = 0.25  # chance that a turn carries a document
    document_tokens: tuple[int, int] = (2048, 12288)
    mean_arrival_ms: float = 400.0  # mean gap between new conversations (Poisson arrivals)
    mean_think_ms: float = 20_000.0  # mean gap between a conversation's turns
    shared_documents: int = 0  # > 0: a first turn's document is one of these (see the module docstring)
    one_off_requests: int = 0  # prompts sharing nothing, mixed in
    one_off_tokens: tuple[int, int] = (1024, 8192)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 0 or self.system_prompts < 1 or self.block_tokens < 1:
            raise ValueError("conversations >= 0, system_prompts >= 1 and block_tokens >= 1 are required")
        if self.shared_documents < 0 or self.one_off_requests < 0:
            raise ValueError(
                f"shared_documents and one_off_requests must be >= 0, not "
                f"{self.shared_documents} and {self.one_off_requests}"
            )
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, not {self.mean_turns}")
        for name in ("system_prompt_tokens", "user_tokens", "output_tokens", "document_tokens", "one_off_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be a range 0 < low <= high, not {(lo, hi)}")
        if not 0.0 <= self.document_chance <= 1.0:
            raise ValueError(f"document_chance must be in [0, 1], not {self.document_chance}")


def generate(spec: ChatWorkload = ChatWorkload()) -> list[Request]:
    """The workload's requests, ordered by arrival time (ties in generation order)."""
    rng = random.Random(spec.seed)
    ids = itertools.count()
    bt = spec.block_tokens
    # System prompts: a length each, their full blocks' ids, and a Zipf-like popularity (1, 1/2, 1/3, ...).
    prompts = []
    for _ in range(spec.system_prompts):
        length = rng.randint(*spec.system_prompt_tokens)
        prompts.append((length, [next(ids) for _ in range(length // bt)]))
    weights = [1.0 / (i + 1) for i in range(spec.system_prompts)]
    documents = [rng.randint(*spec.document_tokens) for _ in range(spec.shared_documents)]
    document_weights = [1.0 / (i + 1) for i in range(spec.shared_documents)]
    opening: dict[tuple[int, int], list[int]] = {}  # (system prompt, shared document) -> the full blocks' ids
    # A turn ends a conversation with probability 1 / mean_turns, so turns are 1 + geometric.
    p_end = 1.0 / spec.mean_turns

    events: list[tuple[float, int, Request]] = []
    order = itertools.count()
    start = 0.0
    for conversation in range(spec.conversations):
        start += rng.expovariate(1.0 / spec.mean_arrival_ms)
        system = rng.choices(range(spec.system_prompts), weights)[0]
        history, full_ids = prompts[system]
        full_ids = list(full_ids)
        now = start
        first = True
        while True:
            added = rng.randint(*spec.user_tokens)
            if rng.random() < spec.document_chance:
                if first and documents:
                    doc = rng.choices(range(len(documents)), document_weights)[0]
                    history += documents[doc]
                    if (system, doc) not in opening:
                        opening[system, doc] = full_ids + [next(ids) for _ in range(history // bt - len(full_ids))]
                    full_ids = list(opening[system, doc])
                else:
                    added += rng.randint(*spec.document_tokens)
            first = False
            prompt = history + added
            # Blocks up to the last full block of the history keep their ids; the rest is new.
            hash_ids = full_ids + [next(ids) for _ in range(math.ceil(prompt / bt) - len(full_ids))]
            output = rng.randint(*spec.output_tokens)
            request = Request(int(now), prompt, output, tuple(hash_ids), conversation)
            heapq.heappush(events, (now, next(order), request))
            if rng.random() < p_end:
                break
            full_ids = hash_ids[: prompt // bt]
            history = prompt + output
            now += rng.expovariate(1.0 / spec.mean_think_ms)
    for _ in range(spec.one_off_requests):
        prompt = rng.randint(*spec.one_off_tokens)
        now = rng.uniform(0.0, start)
        one_off_ids = tuple(next(ids) for _ in range(math.ceil(prompt / bt)))
        output = rng.randint(*spec.output_tokens)
        heapq.heappush(events, (now, next(order), Request(int(now), prompt, output, one_off_ids)))
    return [heapq.heappop(events)[2] for _ in range(len(events))]


WORKLOADS: dict[str, ChatWorkload] = {
    "chat": ChatWorkload(seed=0),
    "chat-long": ChatWorkload(conversations=1000, mean_turns=6.0, seed=1),
    "chat-short": ChatWorkload(conversations=2000, mean_turns=1.5, seed=2),
    "documents": ChatWorkload(
        conversations=1500,
        mean_turns=1.5,
        shared_documents=8,
        document_chance=0.9,
        document_tokens=(8192, 32768),
        seed=3,
    ),
    "chat+scan": ChatWorkload(conversations=600, one_off_requests=1200, seed=4),
}
"""The generated workloads eviction policies are judged on (bench/policies.py), so that no policy is
tuned to one trace: the default chat; many returning conversations of many turns (a large cache
holds most of them: keeping everything recent is right); many conversations of few turns; a few
long documents read many times; a scan of one-off prompts mixed into a chat. Each has its own seed."""
