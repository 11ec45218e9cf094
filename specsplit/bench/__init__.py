"""`specsplit bench`: one benchmark harness for a running server and for an engine in this process.

A workload (workloads.py) is a list of requests; one driver (load_generator.py) sends them at a rate through a
client (http_client.py for any OpenAI-compatible server, grpc_client.py for this one's gRPC API, engine_client.py
for an engine in this process), each request timed as its user sees it (request_record.py); summary.py turns a run
into throughput and TTFT / TPOT / ITL percentiles (percentiles.py), report.py prints it, plot.py draws it, records.py
writes it with the commit, machine, command and date. serve_process.py starts and stops a `specsplit serve` for
scripts and tests. commands.py is the command line; in_process.py the latency / throughput modes.
"""
