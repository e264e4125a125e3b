"""Load testing specserve with Locust: the locustfile, load shapes, a metrics poller and the report.

`make loadtest` (or `python -m loadtest.run`) drives it; see loadtest/README.md.
"""
