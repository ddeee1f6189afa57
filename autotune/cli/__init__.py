"""The ``autotune`` command line: the parser tree and command registry (``main``) and one module per
command, each with ``add_parser(sub)`` and ``run(args)``; ``args`` declares the flags several
commands share, ``inputs`` reads prompts, models and the strategy from them. Commands only parse and
call the library."""
