"""`bench cluster`: rendezvous placement, failover and throughput over several daemons."""
