"""What the gateway reports about its requests: the request log line, the metrics, and the accounting."""
