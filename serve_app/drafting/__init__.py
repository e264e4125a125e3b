"""Drafts: the models (or rules) that propose tokens for the target to verify, and how they are made.

  layers.py   ReducedVocabDraft: the target's first layers + shared embeddings + a reduced-vocabulary
              head (FR-Spec style); its checkpoint format (specserve_draft.json + model.safetensors)
  distill.py  `specserve distill`: seed prompts -> the target's text and distributions -> training
  eagle3.py   Eagle3Draft: one decoder layer over the target's fused hidden states (EAGLE-3)
  eagle3_worker.py  EagleWorker: the draft interface for it (real features first, then its own states)
  eagle3_io.py  EAGLE-3 drafts on disk: specserve's format and the published one vLLM/SGLang load; export
  eagle3_train.py  `distill --method eagle3`: features in the data, training-time test (unrolled steps)
  self_prompts.py  chat requests the target writes itself (Magpie style), JSONL prompt files
  ngram.py    NgramDraft (`--draft ngram`): prompt lookup, copies what followed the longest repeated
              suffix of the sequence's own context; no model, no forward (its own NgramWorker)

A draft is hosted by a worker with the engine's draft interface: add, remove, prefill(ids, features),
propose(ids, k) -> Proposal, commit(ids, new_tokens, features), info(). A draft whose info() names
`feature_layers` gets the target's hidden states at those layers with every verification.
"""


def draft_worker(draft, pad_id: int = 0, prompt_lookup: bool = False, history_tokens: int = 0,
                 history_shared: bool = False):
    """The worker that hosts a loaded draft: a causal LM (layer-copy, truncated, any HF model) runs in
    a ModelWorker; drafts of other kinds bring their own worker class (`draft.worker_class`). With
    `prompt_lookup`, a model draft's rows may copy from their own context instead (`engine.lookup`), and with
    `history_tokens` from a suffix history of that many tokens of earlier outputs (`engine.history`; one per
    tenant unless `history_shared`)."""
    from serve_app.engine.worker import ModelWorker

    cls = getattr(draft, "worker_class", None)
    worker = cls(draft, pad_id) if cls is not None else ModelWorker(draft, "draft", pad_id)
    if isinstance(worker, ModelWorker):
        worker.prompt_lookup = prompt_lookup
        if prompt_lookup and history_tokens:
            from serve_app.engine.history import LiveOutputs, SuffixHistory

            worker.history, worker.history_shared = SuffixHistory(history_tokens), history_shared
            worker.live = LiveOutputs()
    return worker
