"""Fleet simulation from profiles: the discrete-event step engine (simulate.py), the vectorised fleet
engine (fleetsim.py), what both report (summary.py) and the `specserve simulate` runner (run.py)."""
