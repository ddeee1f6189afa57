"""The ``autotune`` command line: the parser tree (``main``) and one module per command, each with
``add_parser(sub)`` and ``run(args)``. Commands only parse and call the library."""
