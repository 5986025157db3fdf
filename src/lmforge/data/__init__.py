"""The data stages: ingest, filter, dedup and mix, over sharded Parquet records."""
