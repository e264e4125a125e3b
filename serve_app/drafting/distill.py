"""`specserve distill`: train a small draft for a target on text the target itself generates.

1. Seed prompts written for this project (chat, explanations, lists, code, stories) are continued by
   the target: greedily, and `samples` more times sampled (more varied contexts).
2. The forwards that generate the text also give the labels: the target's top-K next-token
   distribution at every position (prompt positions too). Soft targets carry far more signal per
   token than the argmax alone and keep a small draft from over-fitting a small corpus.
3. The token set is the N most frequent tokens of the outputs (plus EOS).
4. A ReducedVocabDraft (first layers of the target, shared embeddings, reduced head) is trained with
   cross-entropy against the teacher distributions restricted to the token set.
Everything is seeded and resumable: data chunks and checkpoints live in the output directory.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from serve_app.drafting.layers import ReducedVocabDraft, save_draft
from serve_app.prompts import encode_chat

TOPICS = [
    "volcanoes", "the moon landing", "photosynthesis", "black holes", "the French revolution", "honey bees",
    "machine learning", "the stock market", "climate change", "the human heart", "ancient Rome", "coffee",
    "electric cars", "the internet", "vaccines", "rainforests", "jazz music", "the Olympic games",
    "earthquakes", "chess", "recycling", "the solar system", "dinosaurs", "meditation", "bread baking",
    "the printing press", "submarines", "friendship", "time management", "public speaking", "gardening",
    "the ocean tides", "mountain climbing", "renewable energy", "the immune system", "libraries",
    "robots", "rivers", "penguins", "democracy", "origami", "trains", "the color of leaves in autumn",
    "a lighthouse keeper", "a lost cat", "a tiny dragon", "a city on Mars", "an old violin", "a talking tree",
    "the water cycle", "airplanes", "sleep", "healthy breakfast", "the Great Wall of China", "bicycles",
    "snowflakes", "the history of money", "learning to swim", "the rainbow", "elephants", "video games",
    "space travel", "a rainy afternoon", "the first day of school", "a haunted house", "pirates",
    "the desert", "board games", "saving money", "writing a resume", "a job interview", "camping",
    "the brain", "volunteering", "social media", "ancient Egypt", "knights and castles", "the weather",
]
TEMPLATES = [
    "Explain {t} to a beginner.", "What are the most important facts about {t}?",
    "Write a short story about {t}.", "List five interesting things about {t}.",
    "Give me three tips related to {t}.", "Why does {t} matter?", "Describe {t} in simple words.",
    "Write a poem about {t}.", "What is the history of {t}?", "Summarize what people should know about {t}.",
    "Compare {t} with something similar.", "Write a short dialogue between two friends about {t}.",
    "Tell me a joke about {t}.", "Write a haiku about {t}.", "What would a child ask about {t}?",
    "Give a step-by-step guide related to {t}.", "Write an email to a friend about {t}.",
    "What are the pros and cons of {t}?", "Describe {t} in two paragraphs.", "Answer briefly: what is {t}?",
    "Write a short news report about {t}.", "Give me a fun fact about {t}, then explain it.",
    "How would you teach {t} to a ten-year-old?", "Write the opening of a fairy tale about {t}.",
]
CODE_TASKS = [
    "reverses a string", "computes the factorial of a number", "checks if a number is prime",
    "counts the words in a sentence", "finds the largest item in a list", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "removes duplicates from a list", "computes Fibonacci numbers",
    "reads a CSV file and prints each row", "sorts a list of dictionaries by a key", "validates an email address",
]
CODE_TEMPLATES = ["Write a Python function that {t}.", "Show a short JavaScript function that {t}.",
                  "How do I write code that {t}? Explain briefly."]


# A second, larger set: new topics and templates (and every mix with the first set). Appended after
# the first set so seed_prompts()[:1932] stays what earlier drafts were trained on.
MORE_TOPICS = [
    "the Roman alphabet", "tea ceremonies", "glaciers", "the periodic table", "owls", "the stock exchange",
    "a broken clock", "the wheel", "hurricanes", "coral reefs", "the violin", "the Renaissance", "wolves",
    "first aid", "electricity", "magnets", "a small bakery", "a lonely astronaut", "the Amazon river",
    "city parks", "football", "the piano", "mushrooms", "typewriters", "the postal service", "kites",
    "a secret garden", "the Vikings", "solar panels", "fossils", "a quiet village", "wind turbines",
    "the moon", "octopuses", "a treasure map", "bridges", "the speed of light", "fire fighters", "yoga",
    "the Arctic", "butterflies", "cooking pasta", "a road trip", "the ancient Greeks", "taxes", "music theory",
    "a birthday party", "the night sky", "spiders", "the history of writing", "a magic school", "clouds",
    "learning a new skill", "teamwork", "a lost key", "the supermarket", "the microscope", "sharks",
    "composting", "a snowy mountain cabin", "tigers", "the telephone", "deep sea creatures", "lighthouses",
]
MORE_TEMPLATES = [
    "Can you help me understand {t}?", "I am curious about {t}. Where should I start?",
    "Write a limerick about {t}.", "Explain {t} in exactly three sentences.",
    "What are common misconceptions about {t}?", "Write a short speech about {t}.",
    "Create a quiz with three questions about {t}.", "What would the world look like without {t}?",
    "Write a diary entry about {t}.", "Give me a list of ten words related to {t}.",
    "Explain {t} as if I were a scientist.", "Write a short product description inspired by {t}.",
]
MORE_CODE_TASKS = [
    "adds two numbers", "counts the vowels in a string", "returns the even numbers in a list",
    "finds the average of a list", "checks whether a year is a leap year", "flattens a nested list",
    "capitalizes every word in a sentence", "computes the sum of the digits of a number",
    "converts a list of strings to integers", "finds the second largest number in a list",
    "prints a multiplication table", "counts how often each word appears in a text",
]
MORE_CODE_TEMPLATES = ["Write a function in Python that {t}, with a docstring.", "Write a C function that {t}.",
                       "Explain line by line a Python function that {t}."]


def seed_prompts(seed: int = 0) -> list[str]:
    """Every template x topic, shuffled reproducibly: the first set, then the second."""
    first = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    first += [tpl.format(t=t) for tpl in CODE_TEMPLATES for t in CODE_TASKS]
    random.Random(seed).shuffle(first)
    second = [tpl.format(t=t) for tpl in TEMPLATES + MORE_TEMPLATES for t in TOPICS + MORE_TOPICS]
    second += [tpl.format(t=t) for tpl in CODE_TEMPLATES + MORE_CODE_TEMPLATES for t in CODE_TASKS + MORE_CODE_TASKS]
    seen = set(first)
    second = [p for p in dict.fromkeys(second) if p not in seen]
    random.Random(seed + 1).shuffle(second)
    return first + second


def sampler_seed(seed: int, pass_no: int, chunk: int) -> int:
    """One sampling seed per (pass, chunk): a chunk samples the same text however often a run resumed."""
    return (seed * 1_000_003 + pass_no * 10_007 + chunk) % (2**63)


@torch.inference_mode()
def continue_prompts(target, prompts: list[list[int]], max_tokens: int, top: int, temperature: float,
                     pad_id: int, eos_id: int | None, seed: int = 0, feature_layers: list[int] | None = None) -> list[dict]:
    """Continue a batch of prompts with the target (greedy, or sampled at `temperature`) and keep the
    target's top-`top` next-token distribution at every position, prompt included, from the same
    forwards: no second teacher pass. Returns [{'ids', 'start', 'idx' [n, top], 'p' [n, top]}], n = len(ids) - 1.
    With feature_layers, each dict also holds 'feat' [n, F] bfloat16: the residual stream entering those
    layers at every position but the last (what an EAGLE-3 draft reads), from the same forwards.
    """
    with capturing(target, feature_layers) as grabbed:
        return _continue(target, prompts, max_tokens, top, temperature, pad_id, eos_id, seed, grabbed)


class capturing:  # noqa: N801 (used as a context manager, named as one)
    """Pre-hooks on the target's decoder layers (id == layer count: the final norm's input) that keep
    the latest forward's residual stream per layer id; removed on exit. None when no layers are asked."""

    def __init__(self, target, layers: list[int] | None):
        self.target, self.layers, self.handles, self.grabbed = target, layers or [], [], None

    def __enter__(self):
        if not self.layers:
            return None
        decoder, self.grabbed = self.target.model, {}
        n = len(decoder.layers)
        for i in self.layers:
            def grab(module, args, kwargs, i=i):
                self.grabbed[i] = args[0] if args else kwargs["hidden_states"]
            self.handles.append((decoder.layers[i] if i < n else decoder.norm).register_forward_pre_hook(grab, with_kwargs=True))
        self.grabbed["layers"] = list(self.layers)
        return self.grabbed

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def grabbed_features(grabbed: dict | None) -> torch.Tensor | None:  # [B, T, F] of the latest forward
    return None if grabbed is None else torch.cat([grabbed[i] for i in grabbed["layers"]], dim=-1).to(torch.bfloat16)


def _continue(target, prompts, max_tokens, top, temperature, pad_id, eos_id, seed, grabbed) -> list[dict]:
    lens = [len(p) for p in prompts]
    width = max(lens)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # left padding
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    out = target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    p_all, idx_all = out.logits[:, :-1].float().softmax(-1).topk(top, dim=-1)  # [B, width - 1, top]
    rows = [[(idx_all[b, width - n:], p_all[b, width - n:])] for b, n in enumerate(lens)]  # n - 1 prompt rows
    feats = grabbed_features(grabbed)
    feat_rows = [[feats[b, width - n:]] for b, n in enumerate(lens)] if feats is not None else None  # n prompt rows
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))  # the prompt each batch row belongs to
    done = torch.zeros(len(prompts), dtype=torch.bool)  # per batch row
    logits = out.logits[:, -1].float()  # [rows, V]
    for step in range(max_tokens):
        p, idx = logits.softmax(-1).topk(top, dim=-1)  # the teacher's distribution for this position
        if temperature > 0:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        for j, b in enumerate(live):
            if not done[j]:
                rows[b].append((idx[j : j + 1], p[j : j + 1]))
                outputs[b].append(int(nxt[j]))
                done[j] = eos_id is not None and int(nxt[j]) == eos_id
        if bool(done.all()) or step == max_tokens - 1:
            break
        if int(done.sum()) * 8 >= len(live):  # drop finished rows once they are an eighth of the batch
            keep = (~done).nonzero().squeeze(1)
            out.past_key_values.batch_select_indices(keep)
            mask, pos, nxt, done = mask[keep], pos[keep], nxt[keep], done[keep]
            live = [live[j] for j in keep.tolist()]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                     past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[:, -1].float()
        if feat_rows is not None:  # the feature of the token just fed, for the rows still generating
            feats = grabbed_features(grabbed)
            for j, b in enumerate(live):
                if not done[j]:
                    feat_rows[b].append(feats[j, -1:])
    result = []
    for b, prompt in enumerate(prompts):
        idx = torch.cat([r[0] for r in rows[b]]).int()
        p = torch.cat([r[1] for r in rows[b]]).half()
        result.append({"ids": prompt + outputs[b], "start": len(prompt), "idx": idx, "p": p})
        if feat_rows is not None:
            result[-1]["feat"] = torch.cat(feat_rows[b])[: len(result[-1]["ids"]) - 1]
    return result


def token_set(data: list[dict], n: int, always: set[int]) -> torch.Tensor:
    counts = Counter(t for d in data for t in d["ids"][d["start"]:])
    chosen = [t for t, _ in counts.most_common(n - len(always)) if t not in always]
    return torch.tensor(sorted(set(chosen) | always), dtype=torch.long)


def batch_groups(data: list[dict], batch_size: int, rng: random.Random):
    """The sequences of each training batch, in a random order of batches. Sorted within windows of
    32 batches so a batch holds sequences of similar length (little padding); the windows and the
    order of the batches stay random."""
    order = list(range(len(data)))
    rng.shuffle(order)
    window = batch_size * 32
    order = [j for w in range(0, len(order), window) for j in sorted(order[w : w + window], key=lambda j: len(data[j]["ids"]))]
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    for group in groups:
        yield [data[j] for j in group]


def batches(data: list[dict], batch_size: int, rng: random.Random):
    """(input_ids [B, T], teacher ids [B, T, K], teacher probs [B, T, K]); padding has zero mass."""
    top = data[0]["idx"].shape[1]
    for chunk in batch_groups(data, batch_size, rng):
        width = max(len(d["ids"]) for d in chunk) - 1
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        t_idx = torch.zeros((len(chunk), width, top), dtype=torch.long)
        t_p = torch.zeros((len(chunk), width, top))
        for b, d in enumerate(chunk):
            n = len(d["ids"]) - 1
            ids[b, :n] = torch.tensor(d["ids"][:-1])
            t_idx[b, :n], t_p[b, :n] = d["idx"].long(), d["p"].float()
        yield ids, t_idx, t_p


def soft_loss(reduced_logits: torch.Tensor, t_idx: torch.Tensor, t_p: torch.Tensor, to_reduced: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft [B, T, N] against teacher top-K [B, T, K] restricted to the set."""
    r = to_reduced[t_idx]  # [B, T, K] reduced index, -1 outside the set
    p = t_p * (r >= 0)
    mass = p.sum(-1, keepdim=True)
    p = p / mass.clamp(min=1e-8)
    logq = reduced_logits.log_softmax(-1).gather(-1, r.clamp(min=0))
    per_pos = -(p * logq).sum(-1)
    valid = mass.squeeze(-1) > 0
    return per_pos[valid].mean()


def reduced_index(draft) -> torch.Tensor:  # [V] long
    """Target token id -> its index in the draft's reduced vocabulary, -1 outside it."""
    to_reduced = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_reduced[draft.token_ids] = torch.arange(draft.token_ids.numel())
    return to_reduced


def optimizer_and_resume(draft, params: list, lr: float, total: int, warmup: int, ckpt: Path | None):
    """AdamW with linear warm-up over `warmup` steps then cosine decay over `total`; restored from `ckpt`
    (with the draft's weights) when it exists. Returns (opt, sched, the checkpoint dict or None)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    state = None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    return opt, sched, state


def train(draft: ReducedVocabDraft, data: list[dict], epochs: int, batch_size: int, lr: float,
          seed: int, ckpt: Path | None = None) -> list[float]:
    """Soft cross-entropy over the reduced vocabulary; returns the mean loss of each epoch."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    to_reduced = reduced_index(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(data) / batch_size)
    total = epochs * steps_per_epoch
    opt, sched, state = optimizer_and_resume(draft, params, lr, total, 20, ckpt)
    start_epoch, losses = 0, []
    if state is not None:
        start_epoch, losses, rng = state["epoch"], state["losses"], state["rng"]
    draft.train()
    with tqdm(total=total, initial=start_epoch * steps_per_epoch, desc="training draft", unit="step") as bar:
        for epoch in range(start_epoch, epochs):
            running, n = 0.0, 0
            for ids, t_idx, t_p in batches(data, batch_size, rng):
                hidden = draft.body(input_ids=ids).last_hidden_state
                loss = soft_loss(draft.reduced_logits(hidden), t_idx, t_p, to_reduced)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                running, n = running + loss.item(), n + 1
                bar.update(1)
                bar.set_postfix(loss=f"{running / n:.3f}")
            losses.append(running / n)
            if ckpt is not None:
                torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "epoch": epoch + 1, "losses": losses, "rng": rng}, ckpt)
    draft.eval()
    return losses


def make_data(target, tokenizer, prompts: list[str | list[dict]], samples: int, temperature: float, max_tokens: int,
              top: int, batch_size: int, seed: int, data_dir: Path, feature_layers: list[int] | None = None) -> list[dict]:
    """A greedy continuation of every prompt, then `samples` sampled ones (more varied contexts, each
    still labelled with the target's own distribution). Chunks of `batch_size` prompts are saved as
    they finish, so an interrupted run resumes, and a run with more prompts reuses the first ones.
    With feature_layers the chunks also hold the target's features (for an EAGLE-3 draft)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = {"max_tokens": max_tokens, "top": top, "batch_size": batch_size, "temperature": temperature, "seed": seed}
    if feature_layers:
        settings["feature_layers"] = list(feature_layers)
    saved = data_dir / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        raise ValueError(f"{data_dir} holds data made with {saved.read_text()}; use those settings or another --out")
    saved.write_text(json.dumps(settings))
    encoded = [encode_chat(tokenizer, p if isinstance(p, list) else [{"role": "user", "content": p}]) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    jobs = [(s, i) for s in range(1 + samples) for i in range(0, len(encoded), batch_size)]
    data = []
    with tqdm(total=len(jobs), desc="generating data", unit="chunk") as bar:
        for s, i in jobs:
            f = data_dir / f"pass{s}-{i // batch_size:05d}.pt"
            chunk_prompts = encoded[i : i + batch_size]
            chunk = torch.load(f) if f.exists() else None
            if chunk is None or [d["ids"][: d["start"]] for d in chunk] != chunk_prompts:
                chunk = continue_prompts(target, chunk_prompts, max_tokens, top, temperature if s else 0.0,
                                         pad, tokenizer.eos_token_id, sampler_seed(seed, s, i), feature_layers)
                torch.save(chunk, f)
            data += chunk
            bar.update(1)
            bar.set_postfix(tokens=sum(len(d["ids"]) - d["start"] for d in data))
    return data


def training_prompts(target, tokenizer, prompts: list | None, num_prompts: int | None, self_prompts: int,
                     seed: int, work: Path, gen_batch_size: int = 64) -> list[str | list[dict]]:
    """`prompts` (strings or chat message lists, e.g. an operator's own traffic) if given, else the first
    `num_prompts` seed prompts; then `self_prompts` requests the target writes itself (Magpie style,
    cached in work/self_prompts/). Those go last, so the data chunks of a run without them are reused."""
    prompts = list(prompts) if prompts is not None else seed_prompts(seed)[:num_prompts]
    if self_prompts:
        from serve_app.drafting.self_prompts import generate_self_prompts, kind_mix

        written = generate_self_prompts(target, tokenizer, self_prompts, seed=seed, batch_size=gen_batch_size,
                                        cache_dir=work / "self_prompts")
        print(f"self-prompts: {len(written)}, kinds {kind_mix(written)}")
        prompts += written
    if not prompts:
        raise ValueError("no prompts to train on")
    return prompts


def distill(target, tokenizer, target_name: str, out_dir: str, num_layers: int = 2, num_tokens: int = 8192,
            num_prompts: int | None = 2400, samples: int = 1, temperature: float = 0.8, max_tokens: int = 128,
            epochs: int = 5, batch_size: int = 16, lr: float = 1e-3, seed: int = 0, gen_batch_size: int = 64,
            teacher_top: int = 32, prompts: list[str | list[dict]] | None = None, self_prompts: int = 0) -> dict:
    """The whole pipeline; re-running with the same out_dir resumes where it stopped.

    Prompts: see training_prompts."""
    out = Path(out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    explicit = prompts is not None
    prompts = training_prompts(target, tokenizer, prompts, num_prompts, self_prompts, seed, work, gen_batch_size)
    t = time.perf_counter()
    data = make_data(target, tokenizer, prompts, samples, temperature, max_tokens, teacher_top, gen_batch_size,
                     seed, work / "data")
    n_out = sum(len(d["ids"]) - d["start"] for d in data)
    data_s, t = time.perf_counter() - t, time.perf_counter()
    print(f"data: {len(data)} sequences, {n_out} generated tokens ({data_s:.0f}s)")
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    tokens = token_set(data, num_tokens, eos)
    draft = ReducedVocabDraft(target, num_layers, tokens)
    losses = train(draft, data, epochs, batch_size, lr, seed, ckpt=work / "checkpoint.pt")
    train_s = time.perf_counter() - t
    meta = {"target": target_name, "init_layers": list(range(num_layers)), "num_prompts": len(prompts),
            "samples": samples, "temperature": temperature, "generated_tokens": n_out, "max_tokens": max_tokens,
            "epochs": epochs, "lr": lr, "seed": seed, "teacher_top": teacher_top,
            "losses": [round(x, 4) for x in losses],
            # only when used, so the default recipe's record stays as it was
            **({"explicit_prompts": True} if explicit else {}), **({"self_prompts": self_prompts} if self_prompts else {}),
            # wall time of this run (a resumed run counts only what it did), so a recipe's cost is on record
            "data_seconds": round(data_s, 1), "train_seconds": round(train_s, 1), "torch_threads": torch.get_num_threads()}
    save_draft(draft, target, out, meta)
    return meta
