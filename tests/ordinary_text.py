"""Ordinary text that holds no credential, for the redaction properties (tests/test_redaction_prose.py).

Every paragraph must come back from the redaction policy byte for byte. Most are the kind of text
an agent's history is full of: prose, prose about authentication and tokens (the words the
keyword-led patterns start from), code, JSON, Markdown, logs, URLs without credentials, and
placeholders where a credential would go. None may hold a value under a secret-named JSON key:
that rule replaces whatever the value is, by design, and is tested elsewhere.
"""

from __future__ import annotations

PROSE = (
    'The quarterly report is due on Friday. Please summarise the three open questions, '
    'draft a short reply for the finance team, and say which section each answer came from.',
    'She walked to the harbour before sunrise, counted the boats that had come back, and wrote the '
    'number on the back of an envelope: eleven, one fewer than the day before.',
    'The bearer of this letter is a friend of the family; give him whatever help he asks for.',
    'Our basic plan covers two users; the premium plan adds single sign-on and an audit trail.',
    "Le jeton d'accès expire après une heure ; le mot de passe reste inchangé. "
    'Das Passwort wird nie im Klartext gespeichert. トークンの有効期限は1時間です。',
    'A token bucket refills at a steady rate: ten tokens per second, up to a burst of fifty.',
    'Tokenization splits text into subword units, so "unbelievable" may cost three tokens while '
    '"cat" costs one. Each token costs $0.000002 on the small model.',
    'Keep the answer under 200 words, cite the page numbers, and do not guess at figures.',
)

AUTH_PROSE = (
    'Explain basic authentication of token refreshes, and why Bearer tokens expire after an hour.',
    'Bearer tokens expire after an hour; refresh tokens last 30 days and are rotated on every use.',
    'Use basic authentication only over TLS: the credentials are merely encoded, not encrypted.',
    'The password field must be at least 12 characters long and include a digit and a symbol. '
    'The password is stored as a salted hash, never in plain text.',
    'password= is the assignment the parser looks for; an empty value means "ask the user". '
    'The secret: nobody ever reads this config file.',
    'Send Authorization: Bearer followed by the access token, or Authorization: Basic followed by '
    'base64(username:password). A missing header gives 401 Unauthorized.',
    'Token: ExpiredSignatureError. Re-authenticate and retry; the refresh endpoint issues a new '
    'token pair. Token: refreshed automatically every 3600 seconds.',
    'API key: see the dashboard under Settings, then Keys. Secret: managed by Vault.',
    'Passwords: minimum 12 characters. Tokens: opaque strings, never parsed by the client.',
    'A private key in PEM starts with -----BEGIN PRIVATE KEY----- and ends with '
    '-----END PRIVATE KEY-----; an OpenSSH key starts with -----BEGIN OPENSSH PRIVATE KEY-----.',
    'The token limit of gpt-4o-mini-2024-07-18 is large, but each token gpt-4o-mini reads still '
    'costs money; the basic tier allows 3 requests per minute.',
    'Request 123e4567-e89b-12d3-a456-426614174000 failed with "invalid token"; commit '
    '3f786850e387550fdab836ed7e6dc881de23001b fixed the token refresh race.',
    'In OAuth 2.0 the client trades an authorization code for an access token and a refresh token; '
    'the token endpoint answers with token_type Bearer and expires_in 3600.',
    'Basic access authentication sends the user name and password with every request, which is '
    'why the token approach replaced it for most APIs. Basic features stay free.',
)

CODE = (
    'token = get_token()\nif not token:\n    raise AuthError("token missing")\n',
    'def refresh(token: str, *, password: str | None = None) -> str:\n'
    '    """Trade a refresh token for a new access token."""\n'
    '    return client.post(url, data={"grant_type": "refresh_token"}).json()["expires_in"]\n',
    'headers = {"Authorization": f"Bearer {token}"}\n'
    'password_field = form.fields["password"]\n'
    'secret_key = settings.SECRET_KEY\n'
    'access_key = os.environ["AWS_ACCESS_KEY_ID"]\n',
    'tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")\n'
    'tokens = tokenizer("basic authentication", return_tensors="pt")\n'
    'password: Optional[str] = None\n'
    'api_key = config.get("api_key")\n',
    'const token = await getToken();\nfetch(url, { headers: { Authorization: `Bearer ${token}` } });\n',
    'curl -H "Authorization: Bearer $TOKEN" https://api.example.com/v1/items\n'
    'curl -u "$USER:$PASS" https://api.example.com/v1/items\n'
    'export TOKEN_TTL=3600\n',
    'SELECT id, password_hash FROM users WHERE token_expires_at < now() AND basic_plan = true;',
    'auth:\n  type: basic\n  token_ttl: 3600\n  password_policy: strict\n  secret: ${DB_PASSWORD}\n',
    'dsn = f"postgres://{user}:{password}@{host}:5432/{db}"\n'
    'url = "mysql://%s:%s@%s/app" % (user, password, host)\n'
    'logged = "redis://app:****@cache.internal:6379/0"\n',
    'if token == expected_token and password != "":\n    login(user, password=password)\n',
)

DATA = (
    '{"max_tokens": 100, "temperature": 0.2, "model": "gpt-4o-mini-2024-07-18"}',
    '{\n  "token_type": "Bearer",\n  "expires_in": 3600,\n  "scope": "read write"\n}',
    '[{"id": 1, "name": "basic"}, {"id": 2, "name": "bearer"}, {"usage": {"input_tokens": 812}}]',
    '{"tokens_per_minute": 90000, "note": "Bearer tokens expire after an hour"}',
    'tokens_used,requests,plan\n18234,42,basic\n90211,310,premium\n',
)

MARKDOWN = (
    '## Authentication\n\n'
    '| scheme | header | notes |\n| --- | --- | --- |\n'
    '| Bearer | `Authorization: Bearer <token>` | tokens expire after an hour |\n'
    '| Basic | `Authorization: Basic <base64 of user:password>` | only over TLS |\n',
    '1. Create a token in **Settings → Tokens**.\n'
    '2. Set `api_key: YOUR_API_KEY` in `config.yaml`.\n'
    '3. Send `Authorization: Bearer YOUR_ACCESS_TOKEN` with each request.\n'
    '> The password field is optional when single sign-on is on.\n',
    '```sh\npython -m pip install "requests>=2.31"\ngit clone git@github.com:example/repo.git\n```\n'
    'See [basic authentication](https://github.com/example/repo/blob/main/README.md#basic-authentication).',
)

URLS = (
    'https://example.com/docs/auth?page=2',
    'https://api.example.com/v2/oauth/token?grant_type=refresh_token&scope=read',
    'Connect to postgres://db.internal:5432/app, or https://example.com:8443/path/to/token/docs.',
    'http://localhost:8000/api/runs?status=waiting&limit=50#top and ftp://files.example.org/pub/',
)

LOGS = (
    '2024-06-01T12:00:00Z INFO auth: token refreshed for user 4412 (expires in 3600s)\n'
    '2024-06-01T12:00:03Z WARN basic auth disabled on port 8080\n'
    '2024-06-01T12:00:07Z ERROR login failed: password incorrect (attempt 3 of 5)\n',
    'Traceback (most recent call last):\n  File "app.py", line 12, in <module>\n'
    "    token = session.token\nAttributeError: 'Session' object has no attribute 'token'\n",
)

PARAGRAPHS: tuple[str, ...] = (*PROSE, *AUTH_PROSE, *CODE, *DATA, *MARKDOWN, *URLS, *LOGS)
"""Every paragraph above: none holds a credential."""
