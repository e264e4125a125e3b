"""Drafts: the models (or rules) that propose tokens for the target to verify, and how they are made.

  layers.py   ReducedVocabDraft: the target's first layers + shared embeddings + a reduced-vocabulary
              head (FR-Spec style); its checkpoint format (specserve_draft.json + model.safetensors)
  distill.py  `specserve distill`: seed prompts -> the target's text and distributions -> training
"""
