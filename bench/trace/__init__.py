"""`bench trace` and `bench report`: a multi-turn workload replayed through the store, the
TTFT model, the tables and the plots."""
