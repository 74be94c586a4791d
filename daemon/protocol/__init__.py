"""The sans-I/O pieces of the protocol: datagram and counter types, the parameters resolver
(a stream's URI values, else the settings), loss detection (gaps and NAK timing), the
retransmit handler and the log cleaner.  They take bytes and ``now`` and return datagrams and
deadlines; they import only the client library, the settings and the C data path."""
