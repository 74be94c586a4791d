"""Back pressure as the driver sees it (docs/BACKPRESSURE.md): each publication's episodes with
their watermarks (:mod:`~slipstream.daemon.pressure.episodes`).  Sans-I/O: the conductor samples
positions into it and sends what it returns."""
