"""Flow control: the strategies a sender's limit follows from its receivers' status messages
(chosen per channel, ``fc=``).  Above :mod:`slipstream.daemon.protocol`, below the streams."""
