"""The kvserve command line: start services, stream a completion."""
