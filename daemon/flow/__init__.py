"""Flow and congestion control: the strategies a sender's limit follows from its receivers'
status messages (``fc=``) and the window a receiver advertises (``cc=``), each an interface
with one module per strategy, chosen by name in :mod:`~slipstream.daemon.flow.registry`.
Above :mod:`slipstream.daemon.protocol`, below the streams."""
