"""`specserve distill --method eagle3 --corpus DIR`: train an EAGLE-3 draft from a stored corpus of token ids.

Nothing large is stored: each training batch is fed through the target once, teacher-forced (no
gradient), which gives both what the draft reads (the target's features at its layers) and what it
learns (the target's next-token distribution over the draft's token set, exact: the head's rows of
those tokens, then a softmax; the full-vocabulary distribution restricted and renormalised to the set).
The draft is then trained as in `eagle3_train` (training-time test over `steps` unrolled steps,
losses weighted 0.8^s). Batches hold about `batch_tokens` tokens of sequences of similar length.

Resumable mid-epoch: a checkpoint every `ckpt_every` steps keeps the weights, the optimizer and the
position in the epoch; the epoch's batch order is a function of (seed, epoch), so a resumed run reads
the same batches from where it stopped. `init`: start from an existing draft (its token set is kept).
"""

from __future__ import annotations

import bisect
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from serve_app.drafting.corpus import Sequence, load_corpus, read_manifest
from serve_app.drafting.distill import capturing, grabbed_features, optimizer_and_resume
from serve_app.drafting.eagle3 import Eagle3Draft, default_feature_layers
from serve_app.drafting.eagle3_train import unroll


def corpus_token_set(seqs: list[Sequence], n: int, always: set[int]) -> torch.Tensor:  # [n] long
    """The n - len(always) most frequent generated tokens, plus `always` (EOS), sorted."""
    counts = np.zeros(65536, dtype=np.int64)
    for s in seqs:
        np.add.at(counts, s.ids[s.prompt_len:].astype(np.int64), 1)
    order = [int(t) for t in np.argsort(-counts, kind="stable") if counts[t] > 0 and int(t) not in always]
    return torch.tensor(sorted(set(order[: n - len(always)]) | always), dtype=torch.long)


def epoch_batches(seqs: list[Sequence], batch_tokens: int, max_len: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's batches as lists of sequence indices: shuffled, sorted by length within windows of
    256 sequences (little padding), cut where the padded size would pass batch_tokens, batches shuffled."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    order = [j for w in range(0, len(order), 256) for j in sorted(order[w : w + 256], key=lambda j: len(seqs[j].ids))]
    batches, cur, width = [], [], 0
    for j in order:
        n = min(len(seqs[j].ids), max_len)
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, width = [], 0
        cur.append(j)
        width = max(width, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


@torch.no_grad()  # not inference_mode: the features go into the draft's graph
def teacher(target, chunk: list[Sequence], layers: list[int], head: torch.Tensor, max_len: int,
            generated_only: bool):
    """One teacher-forced forward over a batch. Returns ids [B, T], feats [B, T-1, F] (bfloat16), the
    teacher's distribution over the draft's tokens p [B, T-1, N] (float32) and valid [B, T-1]: position p
    has a label (token p + 1 exists; with generated_only, token p + 1 is generated, not prompt)."""
    dev = head.device
    width = max(min(len(s.ids), max_len) for s in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    valid = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
    for b, s in enumerate(chunk):
        n = min(len(s.ids), max_len)
        ids[b, :n] = torch.from_numpy(s.ids[:n].astype(np.int64))
        mask[b, :n] = 1
        valid[b, (s.prompt_len - 1 if generated_only else 0) : n - 1] = True
    with capturing(target, layers) as grabbed:  # the residual stream entering those layers, as served
        out = target.model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
    feats = grabbed_features(grabbed)[:, :-1]  # [B, T-1, 3H] bfloat16
    p = (out.last_hidden_state[:, :-1] @ head.T).float().softmax(-1)  # [B, T-1, N]
    return ids.to(dev), feats, p, valid.to(dev)


def dense_losses(draft: Eagle3Draft, ids, feats, p, valid, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy over the unrolled steps against the dense teacher p, and each step's
    top-1 agreement with the teacher (within the token set)."""
    total, agree = 0.0, []
    for s, state in enumerate(unroll(draft, ids, feats, steps)):
        chains = state.shape[1]
        logq = draft.reduced_logits(state).float().log_softmax(-1)  # [B, L, N]
        tp, ok = p[:, s + 1 : s + 1 + chains], valid[:, s + 1 : s + 1 + chains]
        per_pos = -(tp * logq).sum(-1)  # [B, L]
        total = total + 0.8**s * (per_pos[ok].mean() if ok.any() else per_pos.sum() * 0)
        with torch.no_grad():
            hit = logq.argmax(-1) == tp.argmax(-1)
            agree.append(float(hit[ok].float().mean()) if ok.any() else 0.0)
    return total, agree


def train_from_corpus(draft: Eagle3Draft, target, seqs: list[Sequence], epochs: float, batch_tokens: int, lr: float,
                      seed: int, steps: int = 3, ckpt: Path | None = None, bf16: bool = False, max_len: int = 1024,
                      generated_only: bool = False, ckpt_every: int = 100, deadline: float | None = None) -> list[dict]:
    """Returns per (part of an) epoch {'epoch', 'steps', 'loss', 'agree'}. epochs may be fractional (the
    last epoch stops part way). deadline: a time.time() after which training stops at the next checkpoint."""
    torch.manual_seed(seed)
    params = [q for q in draft.parameters() if q.requires_grad]
    # batches per epoch: each epoch's own (its shuffle groups sequences differently); a fractional last
    # epoch is cut short. Step `done` is batch `done - starts[e]` of epoch e.
    sizes = [len(epoch_batches(seqs, batch_tokens, max_len, seed, e)) for e in range(math.ceil(epochs))]
    if epochs % 1:
        sizes[-1] = max(1, int(epochs % 1 * sizes[-1]))
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    total = sum(sizes)
    opt, sched, state = optimizer_and_resume(draft, params, lr, total, 50, ckpt)
    done, history = (state["done"], state["history"]) if state is not None else (0, [])
    head = target.get_output_embeddings().weight[draft.token_ids.to(target.device)].detach()  # [N, H]
    layers = list(draft.feature_layers)
    draft.train()
    loss_sum, agree_sum, n, order = 0.0, [0.0] * steps, 0, None
    with tqdm(total=total, initial=done, desc="training eagle3 draft (corpus)", unit="step") as bar:
        while done < total:
            epoch = bisect.bisect_right(starts, done) - 1
            if done == starts[epoch] or order is None:
                order = epoch_batches(seqs, batch_tokens, max_len, seed, epoch)
            batch = order[done - starts[epoch]]
            ids, feats, p, valid = teacher(target, [seqs[j] for j in batch], layers, head, max_len, generated_only)
            with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, agree = dense_losses(draft, ids, feats, p, valid, steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            done += 1
            loss_sum, n = loss_sum + loss.item(), n + 1
            agree_sum = [a + b for a, b in zip(agree_sum, agree + [0.0] * (steps - len(agree)))]
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum / n:.3f}", agree="/".join(f"{a / n:.2f}" for a in agree_sum))
            end_of_epoch = done == starts[epoch] + sizes[epoch]
            if end_of_epoch or done % ckpt_every == 0:
                if end_of_epoch:
                    history.append({"epoch": epoch, "steps": n, "loss": round(loss_sum / n, 4),
                                    "agree": [round(a / n, 4) for a in agree_sum]})
                    loss_sum, agree_sum, n = 0.0, [0.0] * steps, 0
                if ckpt is not None:
                    torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "done": done, "history": history}, ckpt)
                if deadline is not None and time.time() > deadline:
                    break
    if n:  # stopped part way through an epoch (deadline): its figures so far
        history.append({"epoch": bisect.bisect_right(starts, done - 1) - 1, "steps": n, "loss": round(loss_sum / n, 4),
                        "agree": [round(a / n, 4) for a in agree_sum], "partial": True})
    draft.eval()
    return history


def distill_from_corpus(target, tokenizer, target_name: str, corpus_dir: str, out_dir: str, init: str | None = None,
                        epochs: float = 1.0, batch_tokens: int = 4096, lr: float = 5e-4, seed: int = 0,
                        num_tokens: int = 8192, steps: int = 3, feature_layers: list[int] | None = None,
                        bf16: bool | None = None, generated_only: bool = False, limit_tokens: int | None = None,
                        deadline: float | None = None) -> dict:
    """Train (or, with `init`, keep training) an EAGLE-3 draft on the corpus; resumable with the same out_dir.
    limit_tokens: train on the corpus's first sequences holding about that many generated tokens (for a
    curve of quality against corpus size)."""
    from serve_app.drafting.eagle3_io import load_eagle3_dir, save_eagle3

    out = Path(out_dir)
    (out / "work").mkdir(parents=True, exist_ok=True)
    seqs = load_corpus(corpus_dir)
    if limit_tokens is not None:
        kept, total = [], 0
        for s in seqs:
            if total >= limit_tokens:
                break
            kept.append(s)
            total += len(s.ids) - s.prompt_len
        seqs = kept
    manifest = read_manifest(Path(corpus_dir))
    generated = int(sum(len(s.ids) - s.prompt_len for s in seqs))
    if init is not None:
        draft = load_eagle3_dir(init, target).cast_own(torch.float32)
    else:
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        layers = feature_layers or default_feature_layers(target.config.num_hidden_layers)
        draft = Eagle3Draft.from_target(target, corpus_token_set(seqs, num_tokens, eos), layers).cast_own(torch.float32)
    draft = draft.to(target.device)  # a GPU target (`--device cuda`): the draft trains beside it
    if bf16 is None:
        from serve_app.models import cpu_has_bf16

        bf16 = target.device.type == "cuda" or cpu_has_bf16()
    t = time.perf_counter()
    history = train_from_corpus(draft, target, seqs, epochs, batch_tokens, lr, seed, steps,
                                ckpt=out / "work" / "checkpoint.pt", bf16=bf16, generated_only=generated_only,
                                deadline=deadline)
    meta = {"method": "eagle3", "target": target_name, "corpus": str(corpus_dir), "corpus_rounds": manifest["rounds"],
            "corpus_sequences": len(seqs), "generated_tokens": generated, "init": init, "epochs": epochs,
            "batch_tokens": batch_tokens, "lr": lr, "seed": seed, "steps": steps, "bf16_autocast": bf16,
            "generated_only": generated_only, "history": history,
            "train_seconds": round(time.perf_counter() - t, 1), "torch_threads": torch.get_num_threads()}
    save_eagle3(draft.cast_own(target.dtype), target, out, meta)
    return meta
