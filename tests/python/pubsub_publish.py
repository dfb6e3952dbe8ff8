"""Publishes messages with Google's official Pub/Sub client
(`google-cloud-pubsub`, pinned in scripts/test.sh), as a producer outside
sluicegate would. Used by tests/it/pubsub_transport.rs; not a pytest module.

Usage: python pubsub_publish.py PROJECT TOPIC FILE

FILE holds a JSON array; each element is a message: a string (the body,
UTF-8) or an object {"data": str, "attributes": {str: str}}. The emulator
address comes from PUBSUB_EMULATOR_HOST, which the client reads itself.
Prints a JSON array of the server-assigned message ids, in input order,
after every publish is confirmed.
"""

import json
import sys

from google.cloud import pubsub_v1


def main() -> int:
    project, topic, path = sys.argv[1:4]
    with open(path, encoding="utf-8") as f:
        messages = json.load(f)
    publisher = pubsub_v1.PublisherClient()
    topic_path = publisher.topic_path(project, topic)
    futures = []
    for m in messages:
        if isinstance(m, str):
            data, attributes = m, {}
        else:
            data, attributes = m["data"], m.get("attributes", {})
        futures.append(publisher.publish(topic_path, data.encode("utf-8"), **attributes))
    ids = [f.result(timeout=60) for f in futures]
    print(json.dumps(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
