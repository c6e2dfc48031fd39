#!/bin/sh
# The private CA of the compose stack and the certificates it signs, made once into the `certs`
# volume (kept across `down`/`up`; `down -v` deletes it). Every service trusts only this CA:
#   ca.pem                      the CA certificate: STEPSTREAM_SSL_CAFILE and STEPSTREAM_S3_CAFILE
#   kafka-keystore.pem          the broker's key and certificate (CN=kafka), Kafka's PEM key store
#   operator-keystore.pem       the operator client's key and certificate (CN=operator, the super user)
#   operator.properties         kafka-*.sh settings for the operator over the broker's mTLS listener
#   minio/                      MinIO's certificate (CN=minio) and key, for --certs-dir
# Server certificates name both the compose service and localhost, so containers and the host
# verify the same certificate.
set -eu
cd /certs
if [ -f ca.pem ]; then
  echo "certificates already in /certs"
  exit 0
fi

issue() {  # issue NAME SUBJECT-ALT-NAMES: NAME.key and NAME.crt, signed by the CA
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$1.key" -subj "/CN=$1" -out "$1.csr"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=critical,CA:FALSE\n' \
    "$2" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -sha256 \
    -extfile "$1.ext" -out "$1.crt"
  rm "$1.csr" "$1.ext"
}

openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -sha256 \
  -keyout ca.key -subj "/CN=stepstream compose CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.pem
issue kafka "DNS:kafka,DNS:localhost"
issue operator "DNS:operator"
issue minio "DNS:minio,DNS:localhost"

# Kafka's PEM key store: the (PKCS#8, unencrypted) key, then the certificate.
cat kafka.key kafka.crt > kafka-keystore.pem
cat operator.key operator.crt > operator-keystore.pem
cat > operator.properties <<PROPERTIES
security.protocol=SSL
ssl.truststore.type=PEM
ssl.truststore.location=/certs/ca.pem
ssl.keystore.type=PEM
ssl.keystore.location=/certs/operator-keystore.pem
PROPERTIES
mkdir -p minio/CAs
mv minio.crt minio/public.crt
mv minio.key minio/private.key
cp ca.pem minio/CAs/stepstream-ca.pem  # MinIO trusts its own CA too (and need not create CAs/)
rm -f ca.srl kafka.key kafka.crt operator.key operator.crt

# Keys are readable only by the service that uses them: Kafka runs as uid 1000 (appuser in the
# apache/kafka image), MinIO as root; the CA key stays with root. Certificates are public.
chmod 0644 ca.pem minio/public.crt minio/CAs/stepstream-ca.pem
chmod 0600 ca.key minio/private.key
chown 1000 kafka-keystore.pem operator-keystore.pem operator.properties
chmod 0400 kafka-keystore.pem operator-keystore.pem
chmod 0444 operator.properties
