"""Routing: the task router (TF-IDF, nearest centroid), the strategy book, the router's measurement."""
