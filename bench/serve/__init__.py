"""`bench serve`: the trace workload against real vLLM servers with the connector, its TTFT
breakdown and its plot."""
