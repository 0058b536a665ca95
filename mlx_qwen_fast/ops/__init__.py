"""Model-specific ops: one module per op family.

Each module states its contract (shapes, dtypes, units), holds a reference in
plain MLX ops, and dispatches to a backend implementation (``cuda``/``metal``)
where one exists.
"""
