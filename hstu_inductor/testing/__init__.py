"""Test corpora and the spelling grammar, for users and for our own tests.

Nothing here is used by the backend itself; it is shipped so that users can check the backend on
their own machines and so that our tests and benchmarks share one corpus:

- ``spellings_attention``: the table of hand-written spellings of HSTU attention (and of cached
  delta attention) that the "attention" rewriter recognises, with their near-miss twins
  (``docs/patterns.md``, "The table of spellings").
- ``grammar``: a generator of random plain-PyTorch HSTU attention models (and near misses) from a
  seed, one choice per spelling family; ``grammar_run`` runs one in one mode (fake export at
  production sizes, ``torch.compile`` static / dynamic at small sizes) and records what was
  rewritten, why not, and whether it still equals eager (``scripts/spelling_rates.py`` runs many;
  ``docs/patterns.md``, "The spelling grammar").

This package sits on the top floor of the import layers (``tests/patterns/test_import_layers.py``):
it may import ``reference``, ``patterns``, ``ops``, ``backend`` and ``export``; nothing in the
package imports it.
"""
