"""arc-serving-loadtest: a Locust replay of conversation and document traces against an
OpenAI-compatible server, measuring TTFT, inter-token latency and the prefix-cache hit rate.

Run it with ``locust -f PATH/TO/arc_loadtest/locustfile.py --trace TRACE ...`` (the image puts
the locustfile at ``/app/loadtest/locustfile.py``), or from Python with
``arc_loadtest.run.run_replay``.
"""
