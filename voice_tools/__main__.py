"""``python -m voice_tools``: the ``voice-tools`` command, as the console script runs it."""
from voice_tools.launcher import main

raise SystemExit(main())
