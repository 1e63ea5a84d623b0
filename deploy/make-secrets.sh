#!/usr/bin/env bash
# Creates what a deployment needs to authenticate its parts, into one private
# directory (default deploy/secrets, which .gitignore and .dockerignore keep
# out of git and out of image build contexts):
#
#   ca.pem, ca.key            the deployment's CA; every party trusts ca.pem.
#                             Keep ca.key offline once the certificates exist.
#   redis.crt/.key            Redis (TLS on 6380)
#   analyzer.crt/.key         analyzer API and tensor endpoint; also its client
#                             certificate towards collectors (mutual TLS)
#   collector.crt/.key        collector (Flight); also its probe's client cert
#   worker.crt/.key           workers' client certificate (analyzer tensor endpoint)
#   client.crt/.key           the operator's CLI (mutual TLS to the analyzer)
#   service.token             the one token services send: the analyzer to
#                             collectors, workers to the analyzer; collectors
#                             accept only this one
#   analyzer.tokens           what the analyzer accepts: the service token, then
#                             one line per person (admin:TOKEN reads every job)
#   client.token              the operator's own token (the admin line above)
#   task_secret               signs Celery task messages (analyzer and workers)
#   compose.env               REDIS_PASSWORD for `docker compose --env-file`
#
# Server certificates name the service as compose and Kubernetes resolve it,
# plus localhost/127.0.0.1 because the health probes connect over loopback.
# They carry clientAuth as well as serverAuth: with LAYERDIFF_TLS_CA set, a
# service presents its own certificate when it is the client (the analyzer
# towards collectors, every probe towards its own service).
#
# Collectors are dialled by the analyzer at the address users give
# (--collector HOST:PORT); list those names in COLLECTOR_SANS, e.g.
#   COLLECTOR_SANS="DNS:gpu-node-1.example.internal,IP:10.0.3.7" deploy/make-secrets.sh
#
# Usage: deploy/make-secrets.sh [OUT_DIR]    (NAMESPACE=layerdiff for the k8s names)
# An existing OUT_DIR/ca.pem is never overwritten: delete the directory to
# rotate everything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/secrets}"
ns="${NAMESPACE:-layerdiff}"
days="${CERT_DAYS:-825}"

command -v openssl >/dev/null || { echo "make-secrets: openssl is required" >&2; exit 2; }
if [ -e "$out/ca.pem" ]; then
  echo "make-secrets: $out/ca.pem exists; not overwriting (remove $out to rotate)" >&2
  exit 1
fi
umask 077
mkdir -p "$out"
chmod 700 "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
rand() { openssl rand -hex 32; }   # hex: safe in a token file and in a Redis URL

key "$out/ca.key"
openssl req -x509 -new -key "$out/ca.key" -sha256 -days 3650 -subj "/CN=layerdiff deployment CA" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$out/ca.pem"

# issue NAME EKU SANS
issue() {
  local name="$1" eku="$2" sans="$3"
  key "$out/$name.key"
  openssl req -new -key "$out/$name.key" -subj "/CN=$name" -out "$tmp/$name.csr"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$eku"
    echo "subjectKeyIdentifier=hash"
    echo "authorityKeyIdentifier=keyid"
    [ -n "$sans" ] && echo "subjectAltName=$sans"
  } > "$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
    -extfile "$tmp/$name.ext" -out "$out/$name.crt" 2>/dev/null
}
names() {   # the names a service is reached by, in compose and in Kubernetes
  echo "DNS:$1,DNS:$1.$ns.svc,DNS:$1.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
}

issue redis serverAuth "$(names redis)"
issue analyzer serverAuth,clientAuth "$(names analyzer)"
issue collector serverAuth,clientAuth "$(names collector)${COLLECTOR_SANS:+,$COLLECTOR_SANS}"
issue worker clientAuth ""
issue client clientAuth ""

service_token="$(rand)"
operator_token="$(rand)"
printf '%s\n' "$service_token" > "$out/service.token"
{
  echo "# the service token first: the analyzer sends it to collectors, workers send it here"
  echo "$service_token"
  echo "# one line per person; admin: may read every job"
  echo "admin:$operator_token"
} > "$out/analyzer.tokens"
printf '%s\n' "$operator_token" > "$out/client.token"
rand > "$out/task_secret"
printf 'REDIS_PASSWORD=%s\n' "$(rand)" > "$out/compose.env"

# Compose (without swarm) bind-mounts secret files as they are on the host, so
# the containers' users (uid 10001; 999 for Redis) must be able to read them:
# the files are world-readable, the directory (0700) keeps other host users out.
chmod 644 "$out"/*.crt "$out"/*.key "$out"/*.token "$out"/analyzer.tokens "$out"/task_secret "$out"/ca.pem
chmod 600 "$out/ca.key" "$out/compose.env"
echo "make-secrets: wrote $out (keep ca.key offline)"
