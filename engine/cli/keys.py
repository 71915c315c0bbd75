"""``fleet key``: the fleet key every machine shares, its TLS certificate, and the API key."""

from __future__ import annotations

import sys

from engine.errors import FleetError
from engine.fleetkey import api_key_file, create_certificate, create_key, key_file, load_api_key, tls_file


def cmd_key(args) -> int:
    if args.key_cmd == "api":
        key = load_api_key(create=True, force=args.new)
        print(key)
        print(f"(kept in {api_key_file()}; HTTP clients send it as `Authorization: Bearer <key>`)", file=sys.stderr)
        return 0
    path = key_file(args.fleet_key_file)
    if args.key_cmd == "init":
        create_key(path, force=args.force)
        print(f"fleet key written to {path}; copy it to every machine of the fleet")
        if args.tls:
            pem = create_certificate(tls_file(path), force=args.force)
            print(f"fleet TLS certificate written to {pem}; copy it beside the key on every machine "
                  "(without it, the key gives the fleet's certificate)")
        return 0
    if not path.exists():
        raise FleetError(f"no fleet key at {path}: run `fleet key init`")
    print(path)
    return 0


def add_commands(sub) -> None:
    key = sub.add_parser("key", help="the fleet key every machine shares")
    ksub = key.add_subparsers(dest="key_cmd", required=True)
    kinit = ksub.add_parser("init", help="create a new fleet key (and with --tls a certificate of the fleet's own)")
    kinit.add_argument("--force", action="store_true", help="replace an existing key")
    kinit.add_argument("--tls", action="store_true",
                       help="also create a self-signed fleet TLS certificate in place of the one the key gives "
                            "(copy it to every machine too)")
    kinit.add_argument("--fleet-key-file", help="where to write the key (default: the config folder)")
    kshow = ksub.add_parser("path", help="print where the fleet key is")
    kshow.add_argument("--fleet-key-file")
    kapi = ksub.add_parser("api", help="print the API key HTTP clients of `fleet serve` need off loopback "
                                       "(created if there is none)")
    kapi.add_argument("--new", action="store_true", help="replace it with a new key (clients need the new one)")
    key.set_defaults(func=cmd_key)
