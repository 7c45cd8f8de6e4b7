"""The value-level prover's core.

* ``values``: element values (sympy booleans and numbers) and :class:`~.values.Unsupported`;
* ``domain``: coordinate symbols, their ranges, the jagged offsets ``off(b)``;
* ``elements``: the interpreter (``Elements.at(node, idx)``) and its rule registry, filled by
  ``rules_values`` (pointwise, creation), ``rules_layout`` (layout ops, gathers) and ``jagged_rules``
  (row-to-sequence maps, scatters, jagged pad ops, one-hot products);
* ``tables``: constant tensors (buffers) recognised by value;
* ``decide``: sympy -> z3, validity under the facts of a valid jagged batch;
* ``semantics``: HSTU's mask as a predicate, case splitting.
"""
from . import jagged_rules, rules_layout, rules_values  # noqa: F401  (register the value rules)
