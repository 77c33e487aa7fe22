"""The node's side: what runs on cyan and peacock during a release (``flatshare-node``).

``switch`` carries out a release (lock, refusals, journaled steps, history);
``steps`` is the step table; ``plan`` the pure plan of a switch; ``journal``,
``history``, ``store`` (release directories and ``current``), ``lock``,
``drain`` (the voice drain protocol), ``output`` (terminal and release.log),
``status``, and ``cli`` (the entry point the operator's side runs, locally or
over SSH). Nothing here imports the operator's side or the renderer
(adr/0004-release-journal.md).
"""
