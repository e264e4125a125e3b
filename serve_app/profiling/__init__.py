"""Profiles per hardware type: their schema and store format (profiles.py), the profiler that measures
them (profiler.py) and roofline predictions for GPUs not at hand (roofline.py)."""
