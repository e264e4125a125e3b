"""Self-generated chat prompts (Magpie, Xu et al. 2024): the target writes the user's requests.

An instruction-tuned model has seen so many chats that, given only the chat template's text up to
where a user's message begins, it writes a plausible user request and closes the turn itself. No
data set is downloaded, and the requests come from the target's own idea of what users ask, which
is closer to real chat than the project's template seed prompts.

1. The user-turn prefix is derived from the tokenizer's own chat template (a placeholder message,
   cut where the placeholder starts), so it carries the system prompt the template adds by default.
2. The target samples from that prefix until its end-of-turn token (batched, left padding, its KV
   cache; seeded per round). Special tokens other than the end of the turn are never sampled.
3. Some requests become conversations: the target answers, then writes the user's next request.
4. Filtering: strip, drop empty, too short, unfinished (hit the token limit), garbage and duplicate
   requests. A keyword classifier reports the mix of kinds (questions, instructions, code, ...).
Rounds are cached in a directory (the distill work folder), so a re-run does not generate again.
The output saves and loads as JSONL lines `{"prompt": ...}` / `{"messages": [...]}`, the format
`specserve generate` reads and `specserve distill --prompts FILE` takes.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from serve_app.config import SamplingParams
from serve_app.prompts import ROLES, encode_chat

# Private-use characters: no real template or message contains them, so the cut point is unambiguous.
PLACEHOLDER = "\ue000user message\ue000"
# Replies in multi-turn conversations: a little cooler than the requests (a coherent answer matters
# more than a surprising one there; the variety comes from the requests).
REPLY_TEMPERATURE, REPLY_TOP_P = 0.7, 0.9
MIN_WORDS, MAX_CHARS = 3, 1500
KINDS = ("code", "rewrite", "creative", "question", "instruction", "other")


def user_turn_prefix(tokenizer, history: list[dict] | None = None) -> str:
    """The chat template's text up to where the next user message's content starts, after `history`
    (none: the first turn, with the template's default system prompt if it adds one)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self-generated prompts need a model with a chat template")
    text = tokenizer.apply_chat_template((history or []) + [{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    cut = text.find(PLACEHOLDER)
    if cut < 0:
        raise ValueError("the chat template does not copy the user's message verbatim: cannot find where it starts")
    return text[:cut]


def turn_tokens(tokenizer) -> tuple[set[int], set[int]]:
    """(stop ids, banned ids). A turn stops at EOS or at the token the template writes right after a
    user's message when that is an added token (`<|im_end|>`, `<|eot_id|>`, ...). Every other added
    or special token is banned: inside a message it only means the model lost track of the turn."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    after = tokenizer.encode(text[text.find(PLACEHOLDER) + len(PLACEHOLDER):], add_special_tokens=False)
    added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    stops = {tokenizer.eos_token_id} - {None}
    if after and after[0] in added:
        stops.add(after[0])
    return stops, added - stops


@torch.inference_mode()
def sample_turns(target, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                 stops: set[int], banned: set[int], pad_id: int, seed: int) -> list[tuple[list[int], bool]]:
    """Sample a continuation of every prompt until a stop token; (new ids without the stop, finished).
    Batched like `distill.continue_prompts` (left padding, the KV cache, finished rows leave the batch
    once they are an eighth of it), but with top-p and only the last position's logits."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, S] left padding
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    no_go = torch.tensor(sorted(banned), dtype=torch.long)
    outputs: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    live = list(range(len(prompts)))  # the prompt each batch row belongs to
    done = torch.zeros(len(prompts), dtype=torch.bool)  # per batch row
    out = target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    for step in range(max_tokens):
        logits = out.logits[:, -1].float()  # [rows, V]
        logits[:, no_go] = float("-inf")
        nxt = nucleus_sample(logits, temperature, top_p, gen)  # [rows]
        for j, b in enumerate(live):
            if not done[j]:
                t = int(nxt[j])
                if t in stops:
                    done[j] = finished[b] = True
                else:
                    outputs[b].append(t)
        if bool(done.all()) or step == max_tokens - 1:
            break
        if int(done.sum()) * 8 >= len(live):
            keep = (~done).nonzero().squeeze(1)
            out.past_key_values.batch_select_indices(keep)
            mask, pos, nxt, done = mask[keep], pos[keep], nxt[keep], done[keep]
            live = [live[j] for j in keep.tolist()]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = target(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                     past_key_values=out.past_key_values, use_cache=True)
    return list(zip(outputs, finished))


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator,
                   top_k: int = 200) -> torch.Tensor:
    """One token per row of logits [N, V]: temperature, then top-p among the `top_k` likeliest tokens.
    topk instead of a full sort of the vocabulary: on CPU the sort costs about as much as a forward,
    and a small model's tail past the first couple of hundred tokens is noise anyway."""
    probs = (logits / temperature).softmax(-1)
    p, idx = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [N, top_k], descending
    p = p.masked_fill(p.cumsum(-1) - p >= top_p, 0.0)  # keep while the mass before a token is below top_p
    return idx.gather(-1, torch.multinomial(p, 1, generator=gen)).squeeze(-1)


def rejection(text: str, finished: bool) -> str | None:
    """Why a generated request is not kept (None: it is). Cheap checks, each for a failure seen in
    practice: the model stopped at once, rambled past the limit, or wrote symbols instead of words."""
    if not text:
        return "empty"
    if not finished or len(text) > MAX_CHARS:
        return "too long"
    words = text.split()
    if len(words) < MIN_WORDS:
        return "too short"
    letters = sum(c.isalpha() for c in text)
    if "\ufffd" in text or letters < 0.5 * sum(not c.isspace() for c in text):
        return "garbage"
    if len(words) >= 8 and len({w.lower() for w in words}) < 0.3 * len(words):
        return "garbage"  # one phrase over and over
    return None


def normalized(text: str) -> str:
    """The duplicate key: lower case, words only."""
    return " ".join(re.findall(r"\w+", text.lower()))


def first_request(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else next(m["content"] for m in prompt if m["role"] == "user")


KEYWORDS = {
    "code": r"\b(code|python|javascript|java|c\+\+|sql|html|css|function|program|script|algorithm|regex|"
            r"api|debug|compile|class|variable|array|loop)\b",
    "rewrite": r"\b(rewrite|rephrase|paraphrase|proofread|edit|summari[sz]e|translate|shorten|simplify|"
               r"improve|correct the|make (this|it) (more|less))\b",
    "creative": r"\b(story|poem|poems|haiku|song|lyrics|limerick|imagine|fiction|fictional|character|"
                r"joke|fairy tale|creative|dialogue|script for)\b",
    "question": r"(\?\s*$|^(what|why|how|who|when|where|which|is|are|can|could|do|does|should|would|will)\b)",
    "instruction": r"^(please )?(write|explain|describe|list|give|create|provide|tell|help|make|generate|"
                   r"suggest|compare|design|plan|calculate|find|name|outline|analy[sz]e|discuss|develop|i need|i want)\b",
}


def kind(prompt: str | list[dict]) -> str:
    """A cheap keyword label for the first request: code, rewrite, creative, question, instruction or
    other (first match in that order: "write a poem" is creative, "how do I sort a list in Python?" code)."""
    text = first_request(prompt).strip().lower()
    return next((k for k, pattern in KEYWORDS.items() if re.search(pattern, text)), "other")


def kind_mix(prompts: list) -> dict[str, int]:
    counts = Counter(kind(p) for p in prompts)
    return {k: counts[k] for k in KINDS if counts[k]}


def round_seed(seed: int, round_no: int) -> int:
    """One sampling seed per round: a round samples the same text however often a run resumed."""
    return (seed * 1_000_003 + round_no * 7_919 + 17) % (2**63)


def generate_round(target, tokenizer, round_no: int, settings: dict) -> dict:
    """One batch of first requests, some continued into conversations: {'kept': [...], 'dropped': {why: n}}."""
    stops, banned = turn_tokens(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seed = round_seed(settings["seed"], round_no)
    s = settings

    def sample(prompts, max_tokens, temperature, top_p, offset):
        return sample_turns(target, prompts, max_tokens, temperature, top_p, stops, banned, pad, seed + offset)

    prefix = tokenizer.encode(user_turn_prefix(tokenizer), add_special_tokens=False)
    kept: list = []
    dropped: Counter = Counter()
    for ids, finished in sample([prefix] * s["batch_size"], s["max_tokens"], s["temperature"], s["top_p"], 0):
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        why = rejection(text, finished)
        if why:
            dropped[why] += 1
        else:
            kept.append(text)
    # Conversations: the target answers some requests, then writes the user's next one.
    rng = random.Random(seed)
    chosen = [i for i in range(len(kept)) if rng.random() < s["multi_turn"]]
    if chosen:
        chats = [[{"role": "user", "content": kept[i]}] for i in chosen]
        replies = sample([encode_chat(tokenizer, c) for c in chats], s["reply_tokens"], REPLY_TEMPERATURE, REPLY_TOP_P, 1)
        answered = [(i, c + [{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True).strip()}])
                    for i, c, (ids, finished) in zip(chosen, chats, replies) if finished and ids]  # whole answers only
        if answered:
            nexts = sample([tokenizer.encode(user_turn_prefix(tokenizer, c), add_special_tokens=False) for _, c in answered],
                           s["max_tokens"], s["temperature"], s["top_p"], 2)
            for (i, chat), (ids, finished) in zip(answered, nexts):
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                if rejection(text, finished) is None and normalized(text) != normalized(kept[i]):
                    kept[i] = chat + [{"role": "user", "content": text}]  # else it stays a single request
    return {"kept": kept, "dropped": dict(dropped)}


def generate_self_prompts(target, tokenizer, n: int, seed: int = 0, batch_size: int = 32, temperature: float = 1.0,
                          top_p: float = 0.95, max_tokens: int = 96, multi_turn: float = 0.25, reply_tokens: int = 192,
                          cache_dir: str | Path | None = None, stats: dict | None = None) -> list:
    """`n` requests written by the target (strings, or message lists ending in a user turn), filtered
    and deduplicated. Rounds of `batch_size` are generated until `n` are kept; with `cache_dir`, every
    round is saved there and reused by a later call (one asking for more reuses the first rounds).
    `stats`, if given, receives the counts: generated, kept, dropped by reason (duplicates included)."""
    settings = {"seed": seed, "batch_size": batch_size, "temperature": temperature, "top_p": top_p,
                "max_tokens": max_tokens, "multi_turn": multi_turn, "reply_tokens": reply_tokens,
                "prefix": user_turn_prefix(tokenizer)}
    cache = Path(cache_dir) if cache_dir is not None else None
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        saved = cache / "settings.json"
        if saved.exists() and json.loads(saved.read_text()) != settings:
            raise ValueError(f"{cache} holds prompts made with {saved.read_text()}; use those settings or another --out")
        saved.write_text(json.dumps(settings))
    prompts: list = []
    seen: set[str] = set()
    dropped: Counter = Counter()
    generated = 0
    max_rounds = 4 * -(-n // batch_size) + 4  # a model that writes nothing usable must not loop forever
    with tqdm(total=n, desc="self-prompts", unit="prompt") as bar:
        for r in range(max_rounds):
            if len(prompts) >= n:
                break
            f = cache / f"round-{r:05d}.json" if cache is not None else None
            if f is not None and f.exists():
                result = json.loads(f.read_text())
            else:
                result = generate_round(target, tokenizer, r, settings)
                if f is not None:
                    f.write_text(json.dumps(result, ensure_ascii=False))
            generated += len(result["kept"]) + sum(result["dropped"].values())
            dropped.update(result["dropped"])
            for p in result["kept"]:
                key = normalized(first_request(p))
                if key in seen:
                    dropped["duplicate"] += 1
                elif len(prompts) < n:
                    seen.add(key)
                    prompts.append(p)
                    bar.update(1)
            bar.set_postfix(generated=generated, **{k.replace(" ", "_"): v for k, v in sorted(dropped.items())})
    if len(prompts) < n:
        print(f"self-prompts: only {len(prompts)} of {n} usable after {max_rounds} rounds")
    if stats is not None:
        stats.update(generated=generated, kept=len(prompts), dropped=dict(dropped))
    return prompts


def save_prompts(path: str | Path, prompts: list) -> None:
    """JSONL, one `{"prompt": text}` or `{"messages": [...]}` per line (what `specserve generate` reads)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p} if isinstance(p, str) else {"messages": p}, ensure_ascii=False) + "\n")


def load_prompts(path: str | Path) -> list:
    """Prompts from a JSONL file of `{"prompt": text}` / `{"messages": [...]}` lines (blank lines skipped);
    a ValueError naming the line for anything else, so a bad file fails before any work starts."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    prompts: list = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: malformed JSON: {e.msg}") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f'{path}:{i}: expected an object with "prompt" or "messages"')
        unknown = set(obj) - {"prompt", "messages", *SamplingParams.model_fields}  # a generate file's settings: ignored
        if unknown:
            raise ValueError(f"{path}:{i}: unknown field(s) {sorted(unknown)}")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise ValueError(f'{path}:{i}: "prompt" must be a non-empty string')
            prompts.append(obj["prompt"])
            continue
        messages = obj["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
                or not any(m["content"].strip() for m in messages)):
            raise ValueError(f'{path}:{i}: "messages" must be a non-empty list of {{"role": one of {ROLES}, "content": string}}')
        prompts.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
