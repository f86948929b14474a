"""Reference sections of docs/ generated from the code and the schemas (see tools/gen_docs.py)."""
