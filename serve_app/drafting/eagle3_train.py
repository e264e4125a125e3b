"""`specserve distill --method eagle3`: train an EAGLE-3 draft on text the target itself generates.

The data is the layer-copy recipe's (distill.make_data: the target continues prompts, its top-K
distribution labels every position) plus, from the same forwards, the target's features at the
draft's layers. Training unrolls the draft over `steps` draft steps ("training-time test", EAGLE-3):
step 0 reads the target's real features; step s reads the draft's own output state from step s - 1
(the true next token's embedding still comes in), so it learns to draft from its own states as it
will at serving time. Step s at position p attends to the real positions 0..p and to its own chain's
earlier steps, exactly what the cached draft sees when it proposes. The loss is the soft
cross-entropy against the target's distribution restricted to the draft's tokens, weighted 0.8^s.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from serve_app.drafting.distill import batch_groups, optimizer_and_resume, reduced_index, soft_loss, token_set
from serve_app.drafting.eagle3 import Eagle3Draft


def unroll(draft: Eagle3Draft, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The draft's output states over `steps` unrolled steps, all positions at once.

    ids [B, T]: the sequences; feats [B, T-1, F]: the target's features at positions 0..T-2.
    Returns states[s] [B, T-2-s, H]: at index p, the state of the chain that started at real position p
    after s own steps; it predicts token p + s + 2 (whose label is the target's distribution at p+s+1).
    """
    attn = draft.self_attn
    bsz, n = feats.shape[:2]
    groups = attn.num_key_value_groups
    hidden = draft.fuse(feats)  # [B, n, H]
    keys, values, states = [], [], []
    for s in range(steps):
        chains = n - s - 1
        if chains <= 0:
            break
        tok = ids[:, 1 + s : 1 + s + chains]  # the true token p + s + 1 at chain p
        hid = hidden[:, :chains]
        emb = draft.embed_tokens(tok).to(hid.dtype)
        x = torch.cat([draft.input_layernorm(emb), draft.hidden_norm(hid)], dim=-1)  # [B, L, 2H]
        pos = (torch.arange(chains, device=ids.device) + s)[None].expand(bsz, chains)
        cos, sin = draft.rotary_emb(hid, pos)
        shape = (bsz, chains, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, L, d]
        k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv_heads, L, d]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(repeat_kv(k, groups))
        values.append(repeat_kv(v, groups))
        # real positions 0..p (step 0's keys), causal ...
        scores = [q @ keys[0].transpose(-1, -2) * attn.scaling]  # [B, heads, L, n-1]
        causal = torch.ones(chains, keys[0].shape[2], dtype=torch.bool, device=ids.device).tril()
        scores[0] = scores[0].masked_fill(~causal, float("-inf"))
        # ... and this chain's own earlier steps (one key each: the diagonal)
        scores += [(q * keys[j][:, :, :chains]).sum(-1, keepdim=True) * attn.scaling for j in range(1, s + 1)]
        weights = torch.cat(scores, dim=-1).softmax(-1).to(values[0].dtype)
        n0 = keys[0].shape[2]
        out = weights[..., :n0] @ values[0]
        for j in range(1, s + 1):
            out = out + weights[..., n0 + j - 1 : n0 + j] * values[j][:, :, :chains]
        h = hid + attn.o_proj(out.transpose(1, 2).reshape(bsz, chains, -1))
        h = h + draft.mlp(draft.post_attention_layernorm(h))
        states.append(h)
        hidden = h
    return states


def eagle_batches(data: list[dict], batch_size: int, rng: random.Random):
    """(ids [B, T], feats [B, T-1, F], teacher ids [B, T-1, K], teacher probs [B, T-1, K]); padding has zero mass."""
    for chunk in batch_groups(data, batch_size, rng):
        width = max(len(d["ids"]) for d in chunk)
        top, dim = chunk[0]["idx"].shape[1], chunk[0]["feat"].shape[1]
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        feats = torch.zeros((len(chunk), width - 1, dim), dtype=torch.bfloat16)
        t_idx = torch.zeros((len(chunk), width - 1, top), dtype=torch.long)
        t_p = torch.zeros((len(chunk), width - 1, top))
        for b, d in enumerate(chunk):
            n = len(d["ids"])
            ids[b, :n] = torch.tensor(d["ids"])
            feats[b, : n - 1], t_idx[b, : n - 1], t_p[b, : n - 1] = d["feat"], d["idx"].long(), d["p"].float()
        yield ids, feats, t_idx, t_p


def step_losses(draft: Eagle3Draft, ids, feats, t_idx, t_p, to_reduced, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted training loss over the unrolled steps, and each step's top-1 agreement with the target."""
    total, agree = 0.0, []
    for s, state in enumerate(unroll(draft, ids, feats, steps)):
        chains = state.shape[1]
        logits = draft.reduced_logits(state).float()  # [B, L, N]
        idx, p = t_idx[:, s + 1 : s + 1 + chains], t_p[:, s + 1 : s + 1 + chains]
        total = total + 0.8**s * soft_loss(logits, idx, p, to_reduced)
        with torch.no_grad():
            valid = p.sum(-1) > 0
            hit = draft.token_ids[logits.argmax(-1)] == idx[..., 0]
            agree.append(float(hit[valid].float().mean()) if valid.any() else 0.0)
    return total, agree


def train_eagle3(draft: Eagle3Draft, data: list[dict], epochs: int, batch_size: int, lr: float, seed: int,
                 steps: int = 3, ckpt: Path | None = None, bf16: bool = False) -> list[dict]:
    """Returns per epoch {'loss', 'agree': top-1 agreement per unrolled step}. bf16: autocast the
    forwards (float32 weights and optimizer), much faster on CPUs with native bfloat16."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    to_reduced = reduced_index(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    per_epoch = math.ceil(len(data) / batch_size)
    total = epochs * per_epoch
    opt, sched, state = optimizer_and_resume(draft, params, lr, total, 50, ckpt)
    start, history = 0, []
    if state is not None:
        start, history, rng = state["epoch"], state["history"], state["rng"]
    draft.train()
    with tqdm(total=total, initial=start * per_epoch, desc="training eagle3 draft", unit="step") as bar:
        for epoch in range(start, epochs):
            loss_sum, agree_sum, n = 0.0, [0.0] * steps, 0
            for ids, feats, t_idx, t_p in eagle_batches(data, batch_size, rng):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss, agree = step_losses(draft, ids, feats, t_idx, t_p, to_reduced, steps)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                loss_sum, n = loss_sum + loss.item(), n + 1
                agree_sum = [a + b for a, b in zip(agree_sum, agree + [0.0] * (steps - len(agree)))]
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / n:.3f}", agree="/".join(f"{a / n:.2f}" for a in agree_sum))
            history.append({"loss": round(loss_sum / n, 4), "agree": [round(a / n, 4) for a in agree_sum]})
            if ckpt is not None:
                torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "epoch": epoch + 1, "history": history, "rng": rng}, ckpt)
    draft.eval()
    return history


def distill_eagle3(target, tokenizer, target_name: str, out_dir: str, num_prompts: int | None = 2400,
                   samples: int = 1, temperature: float = 0.8, max_tokens: int = 128, epochs: int = 4,
                   batch_size: int = 16, lr: float = 1e-3, seed: int = 0, num_tokens: int = 8192, steps: int = 3,
                   feature_layers: list[int] | None = None, gen_batch_size: int = 64, teacher_top: int = 32,
                   bf16: bool | None = None, prompts: list | None = None, self_prompts: int = 0) -> dict:
    """The whole EAGLE-3 pipeline; re-running with the same out_dir resumes where it stopped.
    Prompts as in distill.training_prompts."""
    from serve_app.drafting.distill import make_data, training_prompts
    from serve_app.drafting.eagle3 import default_feature_layers
    from serve_app.drafting.eagle3_io import save_eagle3

    out = Path(out_dir)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    explicit = prompts is not None
    prompts = training_prompts(target, tokenizer, prompts, num_prompts, self_prompts, seed, work, gen_batch_size)
    layers = feature_layers or default_feature_layers(target.config.num_hidden_layers)
    t = time.perf_counter()
    data = make_data(target, tokenizer, prompts, samples, temperature, max_tokens, teacher_top, gen_batch_size,
                     seed, work / "data", feature_layers=layers)
    n_out = sum(len(d["ids"]) - d["start"] for d in data)
    data_s, t = time.perf_counter() - t, time.perf_counter()
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    draft = Eagle3Draft.from_target(target, token_set(data, num_tokens, eos), layers).cast_own(torch.float32)
    if bf16 is None:
        from serve_app.models import cpu_has_bf16

        bf16 = cpu_has_bf16()
    history = train_eagle3(draft, data, epochs, batch_size, lr, seed, steps, ckpt=work / "checkpoint.pt", bf16=bf16)
    meta = {"method": "eagle3", "target": target_name, "num_prompts": len(prompts), "samples": samples,
            "temperature": temperature, "generated_tokens": n_out, "max_tokens": max_tokens, "epochs": epochs,
            "lr": lr, "seed": seed, "teacher_top": teacher_top, "steps": steps, "bf16_autocast": bf16,
            "history": history, **({"explicit_prompts": True} if explicit else {}),
            **({"self_prompts": self_prompts} if self_prompts else {}), "data_seconds": round(data_s, 1), "train_seconds": round(time.perf_counter() - t, 1),
            "torch_threads": torch.get_num_threads()}
    save_eagle3(draft.cast_own(target.dtype), target, out, meta)
    return meta

