"""The two operators (kv_cache_scatter, paged_cache_load; docs/design.md §3.3) and the row
index building behind them."""
