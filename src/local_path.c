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
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define NO_LINK (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

/* The absolute, normalized form of path (a fresh string), or NULL (errno
 * set). */
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
	char *norm, *p;
	struct stat st;
	int fd, next, rc;

	*dirfd = -1;
	*abs = NULL;
	if ((norm = normalize(path)) == NULL) {
		if (errno == ENOMEM)
			return KL_ENOMEM;
		kl__error_set(err, KL_EPROVIDER,
			      "local provider: cannot resolve the state "
			      "directory %s: %s",
			      path, strerror(errno));
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
			      strerror(rc));
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
			rc = errno;
			close(fd);
			kl__error_set(err, KL_EPROVIDER,
				      "local provider: cannot open %s%s: %s%s",
				      norm, last ? " as the state directory" : "",
				      strerror(rc),
				      rc == ELOOP || rc == ENOTDIR
					      ? " (symbolic links are not "
						"followed: name the real "
						"directory)"
					      : "");
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
				      strerror(rc));
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
