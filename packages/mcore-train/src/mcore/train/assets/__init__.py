"""Files shipped inside the package: the embedded demo corpus (``tiny_corpus.txt``) and its generator."""
