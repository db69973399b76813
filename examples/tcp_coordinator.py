"""A coordinator on tcp://0.0.0.0:PORT, for engines and clients on other hosts.

    python examples/tcp_coordinator.py [PORT]      (PORT 0: any free port)

Stop it with Ctrl-C.
"""

import socket
import sys

import coordkit


def main(port: int) -> None:
    coord = coordkit.Coordinator(f"tcp://0.0.0.0:{port}")
    endpoint = f"tcp://{socket.gethostname()}:{coord.address.rsplit(':', 1)[1]}"
    print(f"coordinator ({coordkit.IMPLEMENTATION}) listening on {coord.address}")
    print("on each engine host, one per rank N:")
    print(f"  python -m coordkit fake-engine --address {endpoint} --rank N")
    print("on a client host:")
    print(f"  python examples/minimal_client.py {endpoint}")
    print(f"  coordkit stats --address {endpoint}")
    try:
        coord.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5555)
