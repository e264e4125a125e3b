"""`specserve corpus grow`: a committed training corpus of the target's own text, grown in resumable runs.

Stored as token ids, nothing else: teacher distributions and features are recomputed by teacher-forced
forwards when training reads the corpus (`eagle3_corpus.py`), so the corpus stays small (2 bytes per
token: the vocabulary fits in uint16) and one corpus serves any draft recipe.

A run appends rounds until it has added the tokens asked for; each round is written whole (a shard of
ids and a JSONL line per sequence), so a run stopped at any point loses at most the round under way,
and the directory can be committed after every run. A round:
1. prompts: `self_prompts` requests the target writes itself (Magpie style, as `self_prompts`: the
   chat template's text up to a user's message, sampled until the turn ends, filtered; a quarter of
   them answered and followed by the user's next turn) and the next `seed_prompts` template prompts;
2. each prompt is continued by the target once greedily and `samples` times sampled.
   All of it runs through the serving engine (continuous batching, paged KV, prefix caching of the
   shared system prompt), the next round starting while the last one finishes, and every sampled
   request is seeded by its (round, prompt, sample);
3. duplicates are dropped: a prompt seen before (same words), or a sequence already stored; so is a
   prompt with the words of an evaluation or profiling prompt (`bench/prompt_sets.py`): those stay
   held out.
Every sequence keeps its provenance: where its prompt came from, its kind, greedy or sampled, its seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from serve_app.bench.prompt_sets import EVAL_SETS, MORE_CHAT_PROMPTS, PROFILE_PROMPTS
from serve_app.config import EngineConfig, SamplingParams
from serve_app.drafting.distill import seed_prompts
from serve_app.drafting.layers import target_fingerprint
from serve_app.drafting.self_prompts import (REPLY_TEMPERATURE, REPLY_TOP_P, kind, normalized, rejection,
                                             round_seed, turn_tokens, user_turn_prefix)
from serve_app.prompts import encode_chat

FORMAT = "specserve-corpus/1"


@dataclasses.dataclass(frozen=True)
class CorpusSettings:
    """What makes a round's text: fixed for a corpus (a run with other settings is refused)."""

    seed: int = 0
    self_prompts: int = 128
    """Magpie attempts per round (about two thirds survive the filters and the duplicate check)."""
    seed_prompts: int = 48
    """Template seed prompts per round, in `distill.seed_prompts` order."""
    samples: int = 1
    """Sampled continuations per prompt, besides the greedy one."""
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 256
    """Tokens per continuation at most (the held-out evaluation generates up to 128)."""


@dataclasses.dataclass
class Sequence:
    ids: np.ndarray  # [n] uint16: prompt then continuation
    prompt_len: int
    meta: dict


def _key(text: str) -> str:
    return hashlib.sha1(normalized(text).encode()).hexdigest()[:16]


def _ids_key(ids) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.uint16).tobytes()).hexdigest()[:16]


def read_manifest(path: Path) -> dict | None:
    f = path / "corpus.json"
    return json.loads(f.read_text()) if f.exists() else None


def load_corpus(path: str | Path, rounds: int | None = None) -> list[Sequence]:
    """Every stored sequence (of the first `rounds` rounds; None: all the manifest counts), in the order written."""
    path = Path(path)
    if rounds is None:
        manifest = read_manifest(path)
        if manifest is None:
            raise ValueError(f"{path} holds no corpus (no corpus.json): grow one with `specserve corpus grow`")
        rounds = manifest["rounds"]
    out = []
    for r in range(rounds):
        ids = np.fromfile(path / f"round-{r:05d}.u16", dtype="<u2")
        at = 0
        for line in (path / f"round-{r:05d}.jsonl").read_text().splitlines():
            meta = json.loads(line)
            out.append(Sequence(ids[at : at + meta["len"]], meta["prompt_len"], meta))
            at += meta["len"]
        if at != len(ids):
            raise ValueError(f"{path}: round {r}'s ids and index disagree ({len(ids)} ids, index says {at})")
    return out


MAGPIE = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 96, "multi_turn": 0.25, "reply_tokens": 192}
"""How the target writes requests (as `self_prompts.generate_self_prompts` by default)."""


@dataclasses.dataclass
class _Round:
    r: int
    pending: int = 0  # requests of this round not finished yet (it is written when none are left)
    rows: list = dataclasses.field(default_factory=list)  # (order, ids, meta)
    started: bool = False


class _Pipeline:
    """Every request of every round goes through one engine, and the next round starts while the last
    one's continuations still run, so the batch stays full (continuous batching across rounds, not
    only within one). A round's requests chain by callbacks: the target writes a request, maybe answers
    it and writes the next turn, then the prompt is continued greedily and sampled. Every sampled
    request is seeded by (round, index), so its text does not depend on what it was batched with."""

    def __init__(self, engine, models, settings: CorpusSettings, seen_prompts: set, seen_ids: set, held_out: set,
                 bar):
        self.engine, self.tok, self.settings, self.bar = engine, models.tokenizer, settings, bar
        self.seen_prompts, self.seen_ids, self.held_out = seen_prompts, seen_ids, held_out
        self.seeds = seed_prompts(settings.seed)
        self.stops, banned = turn_tokens(self.tok)
        self.ban = {t: -100.0 for t in banned}
        self.prefix = self.tok.encode(user_turn_prefix(self.tok), add_special_tokens=False)
        self.inflight: dict[str, tuple] = {}
        self.dropped: Counter = Counter()
        self.added = 0

    # ---- plumbing ----
    def submit(self, rnd: _Round, ids: list[int], params: SamplingParams, then) -> None:
        req = self.engine.submit(ids, params)
        rnd.pending += 1
        self.inflight[req.id] = (rnd, req, then)

    def step(self) -> list[_Round]:
        """One engine step; returns the rounds it completed."""
        done = []
        for req, out in self.engine.step():
            if out.finished and req.id in self.inflight:
                rnd, req, then = self.inflight.pop(req.id)
                then(list(req.output_ids), out.finish_reason or "")
                rnd.pending -= 1
                if rnd.pending == 0:
                    done.append(rnd)
        return done

    def _turn(self, r: int, i: int, salt: int, max_tokens: int, temperature: float, top_p: float) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, logit_bias=self.ban,
                              stop_token_ids=sorted(self.stops), seed=(round_seed(self.settings.seed, r) + 7 * i + salt) % 2**31)

    def _text(self, ids: list[int], finish: str) -> tuple[str, bool]:
        finished = finish == "stop"
        if ids and ids[-1] in self.stops:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=True).strip(), finished

    # ---- a round ----
    def start(self, r: int) -> _Round:
        rnd, s = _Round(r), self.settings
        rnd.pending += 1  # held while submitting, so the round cannot complete before all of it is queued
        for i in range(s.self_prompts):
            self.submit(rnd, self.prefix, self._turn(r, i, 0, MAGPIE["max_tokens"], MAGPIE["temperature"], MAGPIE["top_p"]),
                        lambda ids, fin, i=i: self._request(rnd, i, ids, fin))
        at = r * s.seed_prompts
        for j, text in enumerate(self.seeds[at : at + s.seed_prompts]):
            self._prompt(rnd, (1, at + j), f"seed:{at + j}", text, text)
        rnd.pending -= 1
        return rnd

    def _request(self, rnd: _Round, i: int, ids: list[int], finish: str) -> None:
        text, finished = self._text(ids, finish)
        why = rejection(text, finished)
        if why:
            self.dropped[why] += 1
            return
        if random.Random(round_seed(self.settings.seed, rnd.r) * 31 + i).random() >= MAGPIE["multi_turn"]:
            self._prompt(rnd, (0, i), f"self:{rnd.r}:{i}", text, text)
            return
        chat = [{"role": "user", "content": text}]
        self.submit(rnd, encode_chat(self.tok, chat),
                    self._turn(rnd.r, i, 1, MAGPIE["reply_tokens"], REPLY_TEMPERATURE, REPLY_TOP_P),
                    lambda ids, fin: self._reply(rnd, i, chat, ids, fin))

    def _reply(self, rnd: _Round, i: int, chat: list, ids: list[int], finish: str) -> None:
        answer, finished = self._text(ids, finish)
        if not (finished and answer):  # whole answers only; else it stays a single request
            self._prompt(rnd, (0, i), f"self:{rnd.r}:{i}", chat[0]["content"], chat[0]["content"])
            return
        chat = chat + [{"role": "assistant", "content": answer}]
        prefix = self.tok.encode(user_turn_prefix(self.tok, chat), add_special_tokens=False)
        self.submit(rnd, prefix, self._turn(rnd.r, i, 2, MAGPIE["max_tokens"], MAGPIE["temperature"], MAGPIE["top_p"]),
                    lambda ids, fin: self._next(rnd, i, chat, ids, fin))

    def _next(self, rnd: _Round, i: int, chat: list, ids: list[int], finish: str) -> None:
        text, finished = self._text(ids, finish)
        first = chat[0]["content"]
        ok = rejection(text, finished) is None and normalized(text) != normalized(first)
        prompt = chat + [{"role": "user", "content": text}] if ok else first
        self._prompt(rnd, (0, i), f"self:{rnd.r}:{i}", prompt, first)

    def _prompt(self, rnd: _Round, order: tuple, source: str, prompt, first: str) -> None:
        """A finished prompt: checked against what is held out or stored, then continued."""
        key = _key(first)
        if key in self.held_out or key in self.seen_prompts:
            self.dropped["held-out prompt" if key in self.held_out else "repeated prompt"] += 1
            return
        self.seen_prompts.add(key)
        ids = encode_chat(self.tok, prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        s = self.settings
        for sample in range(1 + s.samples):
            seed = (round_seed(s.seed, rnd.r) + 1_009 * order[1] + 100_003 * order[0] + sample) % 2**31
            params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature if sample else 0.0,
                                    top_p=s.top_p if sample else 1.0, seed=seed if sample else None)
            meta = {"prompt_len": len(ids), "source": source, "kind": kind(prompt),
                    "turns": sum(m["role"] == "user" for m in prompt) if isinstance(prompt, list) else 1,
                    "mode": "sampled" if sample else "greedy", "seed": params.seed, "key": key}
            self.submit(rnd, ids, params, lambda gen, fin, ids=ids, meta=meta, o=(*order, sample):
                        self._store(rnd, o, ids, gen, fin, meta))

    def _store(self, rnd: _Round, order: tuple, prompt: list[int], gen: list[int], finish: str, meta: dict) -> None:
        seq = prompt + gen
        k = _ids_key(seq)
        if not gen or k in self.seen_ids:
            self.dropped["empty" if not gen else "repeated sequence"] += 1
            return
        self.seen_ids.add(k)
        rnd.rows.append((order, np.asarray(seq, dtype="<u2"), {"len": len(seq), **meta, "finish": finish}))
        self.added += len(gen)
        self.bar.update(len(gen))


def grow(models, out_dir: str | Path, tokens: int, settings: CorpusSettings | None = None,
         max_batch: int = 160, max_rounds: int | None = None) -> dict:
    """Append rounds to the corpus at out_dir until at least `tokens` new tokens are stored (or
    `max_rounds` rounds ran). Returns the manifest."""
    import torch

    from serve_app.engine.scheduler import Engine

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = settings or CorpusSettings()
    manifest = read_manifest(out) or {
        "format": FORMAT, "target": models.target_name, "target_fingerprint": target_fingerprint(models.target),
        "settings": dataclasses.asdict(settings), "rounds": 0, "runs": [], "totals": {}}
    if manifest["settings"] != dataclasses.asdict(settings):
        raise ValueError(f"{out} was grown with {manifest['settings']}; use those settings or another directory")
    if manifest["target_fingerprint"] != target_fingerprint(models.target):
        raise ValueError(f"{out} holds text of another target ({manifest['target']})")
    stored = load_corpus(out) if manifest["rounds"] else []  # a later round never repeats these
    held_out = {_key(p) for p in PROFILE_PROMPTS + MORE_CHAT_PROMPTS + [q for texts in EVAL_SETS.values() for q in texts]}
    engine = Engine.from_models(dataclasses.replace(models, draft=None),
                                EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=max(512, max_batch),
                                             max_num_tokens=max_batch * 640, max_k=0))
    t0, first = time.perf_counter(), manifest["rounds"]
    written, last_write, interrupted = 0, t0, False  # generated tokens of the rounds written by this run
    with tqdm(total=tokens, desc="corpus: tokens added", unit="tok") as bar:
        pipe = _Pipeline(engine, models, settings, {s.meta["key"] for s in stored}, {_ids_key(s.ids) for s in stored},
                         held_out, bar)
        rounds: list[_Round] = []  # started, not yet written, in order
        nxt = first
        try:
            while True:
                # start a round while the batch has room for it and more tokens are wanted
                per_round = written / max(1, manifest["rounds"] - first) if manifest["rounds"] > first else 0
                wanted = max(pipe.added, written + per_round * len(rounds)) < tokens
                # up to 4 rounds open: admission is first come, first served, so a round's last links
                # (reply, next turn, continuation) queue behind later rounds' work and finish late
                if (wanted and len(rounds) < 4 and len(pipe.inflight) < max_batch
                        and (max_rounds is None or nxt - first < max_rounds)):
                    rounds.append(pipe.start(nxt))
                    nxt += 1
                if not pipe.inflight:
                    break
                pipe.step()
                while rounds and rounds[0].pending == 0:  # written in order, each whole, then counted
                    written += _write_round(out, rounds.pop(0))
                    last_write = time.perf_counter()
                    manifest["rounds"] += 1
                    _write_manifest(out, manifest, None)
        except KeyboardInterrupt:  # Ctrl-C: the rounds written so far stay; those under way are dropped
            interrupted = True
    seconds = last_write - t0  # up to the last round written: what the run's tokens cost
    run = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": manifest["rounds"] - first,
           "tokens_added": written, "seconds": round(seconds, 1), "tokens_per_s": round(written / max(seconds, 1e-9), 1),
           "dropped": dict(pipe.dropped), "max_batch": max_batch, "dtype": str(models.target.dtype).removeprefix("torch."),
           "torch_threads": torch.get_num_threads(), **({"interrupted": True} if interrupted else {})}
    _write_manifest(out, manifest, run)
    return manifest


def _write_round(out: Path, rnd: _Round) -> int:
    """The round's ids and index; the manifest that counts it is written after (a crash in between
    leaves files no manifest counts, overwritten by the next run). Returns its generated tokens."""
    rows = sorted(rnd.rows, key=lambda row: row[0])
    np.concatenate([ids for _, ids, _ in rows] or [np.zeros(0, "<u2")]).tofile(out / f"round-{rnd.r:05d}.u16")
    (out / f"round-{rnd.r:05d}.jsonl").write_text("".join(json.dumps(meta) + "\n" for _, _, meta in rows))
    return sum(meta["len"] - meta["prompt_len"] for _, _, meta in rows)


def summarize(seqs: list[Sequence]) -> dict:
    """Totals of a corpus: sequences, tokens (all / generated), and the mix of kinds, modes and sources."""
    gen = [len(s.ids) - s.prompt_len for s in seqs]
    return {"sequences": len(seqs), "tokens": int(sum(len(s.ids) for s in seqs)), "generated_tokens": int(sum(gen)),
            "bytes": int(2 * sum(len(s.ids) for s in seqs)),
            "kinds": dict(Counter(s.meta["kind"] for s in seqs).most_common()),
            "modes": dict(Counter(s.meta["mode"] for s in seqs)),
            "sources": dict(Counter(s.meta["source"].split(":")[0] for s in seqs)),
            "multi_turn": sum(s.meta.get("turns", 1) > 1 for s in seqs),
            "finished_by_eos": sum(s.meta["finish"] == "stop" for s in seqs)}


def _write_manifest(out: Path, manifest: dict, run: dict | None) -> None:
    if run is not None:
        manifest["runs"].append(run)
    manifest["totals"] = summarize(load_corpus(out, manifest["rounds"]))
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")
