"""nanoserve's benchmarks, one job per file; `python -m nanoserve.bench` (main.py) runs them all.

    workload.py     what every benchmark shares: the requests (random, or a named workload), an engine
                    run's Result and its Steps, the default random Llama, percentiles
    throughput.py   offline: a whole workload queued at once on nanoserve (continuous, static) and on
                    transformers (generate, continuous batching), side by side; prefix caching on and
                    off; one process against tensor-parallel ranks
    roofline.py     the machine's limits (GEMM FLOP/s, copy bytes/s), a step's roofline time, the CPU line
    online.py       Poisson arrivals into the running engine: TTFT, TPOT and goodput per request rate
    http_client.py  the same arrivals over HTTP to a running server, timed from the client's side
    profile.py      where one decode step's time goes
    llama_cpp.py    llama.cpp's llama-batched-bench as a peer, per batch size
    main.py         the command line: which of the above a run does

Ratios, not absolute numbers, are the point: the engines compared run on the same machine in the
same run.
"""
