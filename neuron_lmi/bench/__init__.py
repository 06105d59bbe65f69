"""``neuron-lmi bench``: a bounded load generator for OpenAI-, TGI- and LMI-compatible servers.

``workload`` makes the requests, ``protocols`` speaks the three wire formats, ``runner`` sends them
at each concurrency level, ``report`` turns the results into a table, JSON/CSV and a plot.
"""
