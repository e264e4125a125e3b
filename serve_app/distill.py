"""`specserve distill`: train a small draft for a target on text the target itself generates.

1. Seed prompts written for this project (chat, explanations, lists, code, stories) are greedily
   continued by the target through the batched engine.
2. One teacher pass stores the target's top-K next-token distribution at every position of that
   text (prompt positions too). Soft targets carry far more signal per token than the argmax alone
   and keep a small draft from over-fitting a small corpus.
3. The token set is the N most frequent tokens of the outputs (plus EOS).
4. A ReducedVocabDraft (first layers of the target, shared embeddings, reduced head) is trained with
   cross-entropy against the teacher distributions restricted to the token set.
Everything is seeded and resumable: data and checkpoints live in the output directory.
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

from .config import EngineConfig, SamplingParams
from .draft import ReducedVocabDraft, save_draft
from .prompts import encode_chat
from .scheduler import Engine
from .worker import ModelWorker

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


def seed_prompts(seed: int = 0) -> list[str]:
    """Every template x topic, shuffled reproducibly."""
    prompts = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    prompts += [tpl.format(t=t) for tpl in CODE_TEMPLATES for t in CODE_TASKS]
    random.Random(seed).shuffle(prompts)
    return prompts


def generate_data(target, tokenizer, prompts: list[str], max_tokens: int, batch_size: int) -> list[dict]:
    """Greedy continuations by the target: [{'ids': prompt + output, 'start': len(prompt)}]."""
    engine = Engine(ModelWorker(target, "target", tokenizer.pad_token_id or 0), None, tokenizer,
                    EngineConfig(policy="none", max_batch_size=batch_size, max_k=0))
    encoded = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    reqs = [engine.submit(ids, SamplingParams(max_tokens=max_tokens)) for ids in encoded]
    with tqdm(total=len(reqs), desc="generating data", unit="prompt") as bar:
        done = 0
        while engine.has_work():
            engine.step()
            now = sum(r.finished for r in reqs)
            bar.update(now - done)
            done = now
    return [{"ids": r.prompt_ids + r.output_ids, "start": len(r.prompt_ids)} for r in reqs]


def token_set(data: list[dict], n: int, always: set[int]) -> torch.Tensor:
    counts = Counter(t for d in data for t in d["ids"][d["start"]:])
    chosen = [t for t, _ in counts.most_common(n - len(always)) if t not in always]
    return torch.tensor(sorted(set(chosen) | always), dtype=torch.long)


@torch.inference_mode()
def teacher_targets(target, data: list[dict], top: int, batch_size: int = 8) -> list[dict]:
    """The target's top-`top` next-token distribution at every position: [{'idx', 'p'}] per sequence."""
    out = []
    for i in tqdm(range(0, len(data), batch_size), desc="teacher pass", unit="batch"):
        chunk = data[i : i + batch_size]
        width = max(len(d["ids"]) for d in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, d in enumerate(chunk):
            ids[b, : len(d["ids"])] = torch.tensor(d["ids"])
        probs = target(input_ids=ids).logits.float().softmax(-1)  # right padding: causal, so harmless
        p, idx = probs.topk(top, dim=-1)
        for b, d in enumerate(chunk):
            n = len(d["ids"]) - 1  # position t predicts token t + 1
            out.append({"idx": idx[b, :n].int(), "p": p[b, :n].half()})
    return out


def batches(data: list[dict], soft: list[dict], batch_size: int, rng: random.Random):
    """(input_ids [B, T], teacher ids [B, T, K], teacher probs [B, T, K]); padding has zero mass."""
    order = list(range(len(data)))
    rng.shuffle(order)
    top = soft[0]["idx"].shape[1]
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        width = max(len(data[j]["ids"]) for j in chunk) - 1
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        t_idx = torch.zeros((len(chunk), width, top), dtype=torch.long)
        t_p = torch.zeros((len(chunk), width, top))
        for b, j in enumerate(chunk):
            n = len(data[j]["ids"]) - 1
            ids[b, :n] = torch.tensor(data[j]["ids"][:-1])
            t_idx[b, :n], t_p[b, :n] = soft[j]["idx"].long(), soft[j]["p"].float()
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


def train(draft: ReducedVocabDraft, data: list[dict], soft: list[dict], epochs: int, batch_size: int, lr: float,
          seed: int, ckpt: Path | None = None) -> list[float]:
    """Soft cross-entropy over the reduced vocabulary; returns the mean loss of each epoch."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    to_reduced = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_reduced[draft.token_ids] = torch.arange(draft.token_ids.numel())
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(data) / batch_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start_epoch, losses = 0, []
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, losses, rng = state["epoch"], state["losses"], state["rng"]
    draft.train()
    with tqdm(total=total, initial=start_epoch * steps_per_epoch, desc="training draft", unit="step") as bar:
        for epoch in range(start_epoch, epochs):
            running, n = 0.0, 0
            for ids, t_idx, t_p in batches(data, soft, batch_size, rng):
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


def distill(target, tokenizer, target_name: str, out_dir: str, num_layers: int = 2, num_tokens: int = 8192,
            num_prompts: int = 1200, max_tokens: int = 128, epochs: int = 6, batch_size: int = 16,
            lr: float = 1e-3, seed: int = 0, gen_batch_size: int = 32, teacher_top: int = 32) -> dict:
    """The whole pipeline; re-running with the same out_dir resumes where it stopped."""
    out = Path(out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    data_file = work / "data.json"
    if data_file.exists():
        data = json.loads(data_file.read_text())
    else:
        prompts = seed_prompts(seed)[:num_prompts]
        t = time.perf_counter()
        data = generate_data(target, tokenizer, prompts, max_tokens, gen_batch_size)
        data_file.write_text(json.dumps(data))
        print(f"generated {sum(len(d['ids']) - d['start'] for d in data)} tokens in {time.perf_counter() - t:.0f}s")
    soft_file = work / f"teacher_top{teacher_top}.pt"
    if soft_file.exists():
        soft = torch.load(soft_file)
    else:
        soft = teacher_targets(target, data, teacher_top)
        torch.save(soft, soft_file)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    tokens = token_set(data, num_tokens, eos)
    draft = ReducedVocabDraft(target, num_layers, tokens)
    losses = train(draft, data, soft, epochs, batch_size, lr, seed, ckpt=work / "checkpoint.pt")
    meta = {"target": target_name, "init_layers": list(range(num_layers)), "num_prompts": len(data),
            "max_tokens": max_tokens, "epochs": epochs, "lr": lr, "seed": seed, "teacher_top": teacher_top,
            "losses": [round(x, 4) for x in losses]}
    save_draft(draft, target, out, meta)
    return meta
