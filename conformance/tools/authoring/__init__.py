"""Case authoring: the scheduler-script author (``author``) and the builders of the corpus
cases (``core_cases``, ``conn_cases``, ...), each runnable with ``--check``."""
