"""Choosing the data mixture by experiment: sample mixtures, fit proxy laws, search."""
