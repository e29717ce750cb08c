"""Proof obligations of the spec: z3 lemmas over :mod:`spec.arithmetic`, the bounded
(explicit-state) check of :mod:`spec.model`, the z3 induction step, and seeded mutants."""
