/* SPDX-License-Identifier: MIT */
/*
 * Opening the local provider's state directory so that no other user can
 * redirect it.  A directory is only as safe as the path to it: whoever can
 * rename an ancestor can swap the state directory for another one while a
 * key is held, and a symlink anywhere on the way hands the choice to its
 * owner.  So the path is made absolute and normalized lexically (".."
 * drops the previous name, which is right because no name on the way may
 * be a symlink), then opened one name at a time from "/" with
 * O_NOFOLLOW | O_DIRECTORY, and every directory on the way is checked as
 * OpenSSH's StrictModes checks a home directory: owned by root or the
 * caller and writable by nobody else, except a sticky directory such as
 * /tmp (others cannot rename or remove what is ours in it).  The state
 * directory itself must be the caller's and writable by nobody else.
 *
 * Also here: the default directory, and the directory's secret that keys
 * the names of its files.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define NO_LINK (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* strerror, thread-safe (GNU strerror_r); the text lives in buf or is
 * static. */
#define ERRTEXT(e) strerror_r((e), errbuf, sizeof errbuf)

/* The absolute, normalized form of path (a fresh string), or NULL (errno
 * set: ELOOP for a ".." after a symbolic link, which the kernel would
 * resolve from the link's target, not lexically). */
static char *
normalize(const char *path)
{
	char *cwd = NULL, *joined, *out;
	size_t len, o = 0;
	const char *s;

	if (path[0] != '/') {
		if ((cwd = getcwd(NULL, 0)) == NULL)
			return NULL;
	}
	len = (cwd != NULL ? strlen(cwd) + 1 : 0) + strlen(path) + 1;
	if ((joined = kl__malloc(len)) == NULL) {
		free(cwd);
		errno = ENOMEM;
		return NULL;
	}
	snprintf(joined, len, "%s%s%s", cwd != NULL ? cwd : "",
		 cwd != NULL ? "/" : "", path);
	free(cwd);
	if ((out = kl__malloc(len + 1)) == NULL) {
		kl__free(joined);
		errno = ENOMEM;
		return NULL;
	}
	for (s = joined; *s != '\0';) {
		size_t n;

		while (*s == '/')
			s++;
		n = strcspn(s, "/");
		if (n == 0 || (n == 1 && s[0] == '.')) {
			/* nothing to add */
		} else if (n == 2 && s[0] == '.' && s[1] == '.') {
			struct stat st;

			/* The name dropped is never opened, so check here
			 * that it is no link (an ancestor checked later
			 * keeps others from making it one). */
			out[o] = '\0';
			if (o > 0 && lstat(out, &st) == 0 &&
			    S_ISLNK(st.st_mode)) {
				kl__free(joined);
				kl__free(out);
				errno = ELOOP;
				return NULL;
			}
			while (o > 0 && out[o - 1] != '/')
				o--;
			if (o > 0)
				o--;
		} else {
			out[o++] = '/';
			memcpy(out + o, s, n);
			o += n;
		}
		s += n;
	}
	out[o] = '\0';
	kl__free(joined);
	return out;
}

static int
refuse_ancestor(kl_error *err, const char *dir, const char *anc,
		const struct stat *st)
{
	kl__error_set(err, KL_EPROVIDER,
		      "local provider: refusing the state directory %s: it "
		      "is reached through %s, owned by uid %lu with mode %04o, "
		      "which another user could change (rename it and put "
		      "another directory in its place); use a directory whose "
		      "every ancestor belongs to root or to uid %lu and is "
		      "writable by nobody else, or is sticky like /tmp",
		      dir, anc, (unsigned long)st->st_uid,
		      (unsigned)(st->st_mode & 07777),
		      (unsigned long)geteuid());
	return KL_EPROVIDER;
}

/* An ancestor may be changed by no other user. */
static bool
ancestor_safe(const struct stat *st)
{
	if (st->st_uid != 0 && st->st_uid != geteuid())
		return false;
	return (st->st_mode & (S_IWGRP | S_IWOTH)) == 0 ||
	       (st->st_mode & S_ISVTX) != 0;
}

int
kl__local_dir_open(const char *path, int *dirfd, char **abs, kl_error *err)
{
	char errbuf[128];
	char *norm, *p;
	struct stat st;
	int fd, next, rc;

	*dirfd = -1;
	*abs = NULL;
	if ((norm = normalize(path)) == NULL) {
		if (errno == ENOMEM)
			return KL_ENOMEM;
		if (errno == ELOOP) {
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: refusing the state "
				      "directory %s: a symbolic link on the "
				      "way is followed by \"..\"; name the "
				      "real directory",
				      path);
			return KL_EPROVIDER;
		}
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: cannot resolve the state "
			      "directory %s: %s",
			      path, ERRTEXT(errno));
		return KL_EPROVIDER;
	}
	if (norm[0] == '\0') {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: the state directory cannot be "
			      "/ itself");
		kl__free(norm);
		return KL_EPROVIDER;
	}
	if ((fd = open("/", NO_LINK)) < 0 || fstat(fd, &st) != 0) {
		rc = errno;
		if (fd >= 0)
			close(fd);
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: cannot open /: %s",
			      ERRTEXT(rc));
		kl__free(norm);
		return KL_EPROVIDER;
	}
	if (!ancestor_safe(&st)) {
		close(fd);
		rc = refuse_ancestor(err, norm, "/", &st);
		kl__free(norm);
		return rc;
	}
	/* norm is "/a/b/c": walk it name by name, cutting it in place so
	 * that messages can name the part reached so far. */
	for (p = norm + 1;;) {
		char *slash = strchr(p, '/');
		bool last = slash == NULL;

		if (!last)
			*slash = '\0';
		next = openat(fd, p, NO_LINK);
		if (next < 0 && errno == ENOENT && last) {
			/* Only the state directory itself is made: a
			 * missing ancestor is more likely a typo. */
			if (mkdirat(fd, p, 0700) != 0 && errno != EEXIST)
				next = -1;
			else
				next = openat(fd, p, NO_LINK);
		}
		if (next < 0) {
			bool link;

			rc = errno;
			link = fstatat(fd, p, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
			       S_ISLNK(st.st_mode);
			close(fd);
			if (link)
				kl__error_set(err, KL_EPROVIDER,
					      "local provider: refusing the "
					      "state directory %s: %s is a "
					      "symbolic link, which is not "
					      "followed (another user could "
					      "change it); name the real "
					      "directory",
					      path, norm);
			else
				kl__error_set(err, KL_EPROVIDER,
					      "local provider: cannot open "
					      "%s%s: %s",
					      norm,
					      last ? " as the state directory"
						   : "",
					      ERRTEXT(rc));
			kl__free(norm);
			return KL_EPROVIDER;
		}
		close(fd);
		fd = next;
		if (fstat(fd, &st) != 0) {
			rc = errno;
			close(fd);
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot stat %s: %s", norm,
				      ERRTEXT(rc));
			kl__free(norm);
			return KL_EPROVIDER;
		}
		if (last)
			break;
		if (!ancestor_safe(&st)) {
			close(fd);
			rc = refuse_ancestor(err, path, norm, &st);
			kl__free(norm);
			return rc;
		}
		*slash = '/';
		p = slash + 1;
	}
	/* Another user's directory, or one others may write to, could hold
	 * planted files: refuse it rather than trust it. */
	if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: refusing the state directory "
			      "%s: owned by uid %lu with mode %04o; it must "
			      "belong to uid %lu and be writable by nobody else "
			      "(chown/chmod 0700 it, or remove it and let it "
			      "be made again)",
			      norm, (unsigned long)st.st_uid,
			      (unsigned)(st.st_mode & 07777),
			      (unsigned long)geteuid());
		close(fd);
		kl__free(norm);
		return KL_EPROVIDER;
	}
	*dirfd = fd;
	*abs = norm;
	return KL_OK;
}

/*
 * The default directory, one that no other user can make first: root's is
 * /run/keylock (only root can create in /run; the Debian package ships it
 * through tmpfiles.d), another user's $XDG_RUNTIME_DIR/keylock, else
 * /run/user/UID/keylock when logind made /run/user/UID.  No fallback in a
 * world-writable place such as /tmp: another user could make it first and
 * deny the key to everyone.  KL_EPROVIDER with err filled when there is
 * none.
 */
int
kl__local_default_dir(char **out, kl_error *err)
{
	const char *xdg = getenv("XDG_RUNTIME_DIR"); /* NOLINT */
	char buf[4096];
	struct stat st;
	int n;

	*out = NULL;
	if (geteuid() == 0) {
		n = snprintf(buf, sizeof buf, "/run/keylock");
	} else if (xdg != NULL && xdg[0] == '/') {
		n = snprintf(buf, sizeof buf, "%s/keylock", xdg);
	} else {
		snprintf(buf, sizeof buf, "/run/user/%lu",
			 (unsigned long)geteuid());
		if (stat(buf, &st) != 0) {
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: no default state "
				      "directory: XDG_RUNTIME_DIR is not set "
				      "and %s does not exist; name one with "
				      "local:DIR",
				      buf);
			return KL_EPROVIDER;
		}
		n = snprintf(buf, sizeof buf, "/run/user/%lu/keylock",
			     (unsigned long)geteuid());
	}
	if (n < 0 || (size_t)n >= sizeof buf) {
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: XDG_RUNTIME_DIR is too long");
		return KL_EPROVIDER;
	}
	*out = kl__strndup(buf, strlen(buf));
	return *out != NULL ? KL_OK : KL_ENOMEM;
}

/* Reads the secret: 16 bytes in a regular file of ours, mode 0600, with
 * one link, left open in *sfd.  fd < 0 on return: absent (-ENOENT), or
 * refused (-EPERM, err filled). */
static int
secret_read(int dirfd, const char *path, unsigned char *key, int *sfd,
	    kl_error *err)
{
	struct stat st;
	int fd = openat(dirfd, KL_LOCAL_SECRET,
			O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK |
				O_NOCTTY);

	if (fd < 0)
		return errno == ENOENT ? -ENOENT : -errno;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid() || st.st_nlink != 1 ||
	    (st.st_mode & 077) != 0 || st.st_size != KL_LOCAL_SECRET_LEN ||
	    pread(fd, key, KL_LOCAL_SECRET_LEN, 0) != KL_LOCAL_SECRET_LEN) {
		close(fd);
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: refusing %s/%s: not %d bytes "
			      "in a regular file of uid %lu, mode 0600, with "
			      "one link (damaged or planted); remove it once "
			      "no process uses the directory",
			      path, KL_LOCAL_SECRET, KL_LOCAL_SECRET_LEN,
			      (unsigned long)geteuid());
		return -EPERM;
	}
	*sfd = fd;
	return 0;
}

/* The directory's secret, made first when there is none: a temporary file
 * made with O_EXCL and renamed into place only if no other process got
 * there first, so that nobody ever reads half a secret.  The temporary
 * name is random, not the pid: pids are reused (a process killed before
 * its rename leaves its name behind) and repeat across the containers
 * that may share a directory. */
int
kl__local_secret(int dirfd, const char *path, uint64_t *k0, uint64_t *k1,
		 int *sfd, kl_error *err)
{
	char errbuf[128];
	/* The secret, then the temporary name's random part. */
	unsigned char key[KL_LOCAL_SECRET_LEN + 8];
	uint64_t tag;
	char tmp[64];
	ssize_t n;
	int fd, r;

	for (int tries = 0; tries < 100; tries++) {
		r = secret_read(dirfd, path, key, sfd, err);
		if (r == 0) {
			memcpy(k0, key, 8);
			memcpy(k1, key + 8, 8);
			return KL_OK;
		}
		if (r == -EPERM)
			return KL_EPROVIDER;
		if (r != -ENOENT) {
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot open %s/%s: %s",
				      path, KL_LOCAL_SECRET, ERRTEXT(-r));
			return KL_EPROVIDER;
		}
		if (getrandom(key, sizeof key, 0) != (ssize_t)sizeof key) {
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot get random "
				      "bytes for %s/%s: %s",
				      path, KL_LOCAL_SECRET, ERRTEXT(errno));
			return KL_EPROVIDER;
		}
		memcpy(&tag, key + KL_LOCAL_SECRET_LEN, sizeof tag);
		snprintf(tmp, sizeof tmp, "%s.%016" PRIx64, KL_LOCAL_SECRET,
			 tag);
		fd = openat(dirfd, tmp,
			    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
				    O_CLOEXEC | O_NOCTTY,
			    0600);
		if (fd < 0 && errno == EEXIST)
			continue;
		if (fd < 0) {
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot create %s/%s: %s",
				      path, tmp, ERRTEXT(errno));
			return KL_EPROVIDER;
		}
		n = write(fd, key, KL_LOCAL_SECRET_LEN);
		r = close(fd);
		if (n != KL_LOCAL_SECRET_LEN || r != 0 ||
		    (renameat2(dirfd, tmp, dirfd, KL_LOCAL_SECRET,
			       RENAME_NOREPLACE) != 0 &&
		     errno != EEXIST)) {
			int e = errno;

			unlinkat(dirfd, tmp, 0);
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot make %s/%s: %s",
				      path, KL_LOCAL_SECRET, ERRTEXT(e));
			return KL_EPROVIDER;
		}
		unlinkat(dirfd, tmp, 0); /* when another process won */
	}
	kl__error_set(err, KL_EPROVIDER,
		      "local provider: %s/%s keeps changing", path,
		      KL_LOCAL_SECRET);
	return KL_EPROVIDER;
}
